"""`kvserve diagnose`: why a request log misses the prefix cache. It renders each logged request
as the server does, finds where requests that share a prefix diverge, classifies what sits
there (timestamps, ids, changing numbers, reordered lists, whitespace and template drift), and
measures each class's cost by replaying the log through the simulator with and without it.
See docs/diagnose.md."""

from kvserve.diagnose.analyze import Diagnosis, cleaned_records, diagnose
from kvserve.diagnose.log import LogRecord, RequestLog, read_log

__all__ = ["Diagnosis", "LogRecord", "RequestLog", "cleaned_records", "diagnose", "read_log"]
