"""What a user runs: the `kvserve` command (cli.py, the console script), `kvserve demo`
(demo.py) and the docs reference generator (`python -m kvserve.entrypoints.docs_ref`). The top of
the import graph: nothing in kvserve imports these."""
