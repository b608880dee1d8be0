"""zdelay producer client: schedule messages in Redis for `zdelay run` to deliver."""

from ._core import (
    PROTOCOL,
    VERSION,
    Debounce,
    Enqueued,
    Fenced,
    InvalidJob,
    Job,
    JobExists,
    LayoutTooNew,
    LayoutTooOld,
    NoLane,
    NoNamespace,
    NoTestClock,
    NotApplied,
    ProtocolError,
    ScheduleRefused,
    UnknownDestination,
    Upgrading,
    ZdelayError,
)
from .client import AsyncClient, Client

__all__ = [
    "PROTOCOL", "VERSION", "AsyncClient", "Client", "Debounce", "Enqueued", "Fenced", "InvalidJob", "Job", "JobExists",
    "LayoutTooNew", "LayoutTooOld", "NoLane", "NoNamespace", "NoTestClock", "NotApplied", "ProtocolError", "ScheduleRefused",
    "UnknownDestination", "Upgrading", "ZdelayError",
]
