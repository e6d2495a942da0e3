//! The durable run state machine (being written).
