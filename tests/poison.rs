//! poison
