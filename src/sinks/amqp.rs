//! amqp sink (being written).
