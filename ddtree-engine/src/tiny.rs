//! Placeholder: filled in once fixtures exist.
