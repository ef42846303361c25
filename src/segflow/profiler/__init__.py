"""Profiler: records what the runtime does; Chrome traces, tables and summaries.

>>> import segflow
>>> with segflow.profile() as prof:                 # doctest: +SKIP
...     sess.run(None, feeds)
>>> print(prof.table())                             # doctest: +SKIP
>>> prof.export_chrome_trace("trace.json")          # doctest: +SKIP
"""

from segflow.profiler.events import Category, Event
from segflow.profiler.profiler import Profiler, profile
from segflow.profiler.sink import ACTIVE, DeviceSpanSink, EventSink, active_sink

__all__ = ["ACTIVE", "Category", "DeviceSpanSink", "Event", "EventSink", "Profiler",
           "active_sink", "profile"]
