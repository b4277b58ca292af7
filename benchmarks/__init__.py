"""Peer comparisons beside `kvserve bench` (README.md); a package only so that its lab
(benchmarks/lab/) imports by one name, `benchmarks.lab`, from the scripts, the tests and
`python -m benchmarks.lab.figures`."""
