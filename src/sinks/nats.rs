//! nats sink (being written).
