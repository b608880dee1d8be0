"""zdelay producer client: schedule messages in Redis for `zdelay run` to deliver."""

from ._core import (
    PROTOCOL,
    Debounce,
    Enqueued,
    Fenced,
    InvalidJob,
    Job,
    JobExists,
    NoNamespace,
    NotApplied,
    ProtocolError,
    ScheduleRefused,
    UnknownDestination,
    ZdelayError,
)
from .client import AsyncClient, Client

__all__ = [
    "PROTOCOL", "AsyncClient", "Client", "Debounce", "Enqueued", "Fenced", "InvalidJob", "Job", "JobExists",
    "NoNamespace", "NotApplied", "ProtocolError", "ScheduleRefused", "UnknownDestination", "ZdelayError",
]
