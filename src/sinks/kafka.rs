//! kafka sink (being written).
