//! Integration tests of the node agent against a real registry (Debian's
//! `docker-registry`), real modules built with gcc, and real kmod tools. The kernel
//! boundary is the simulated backend.

#[path = "../support/mod.rs"]
mod support;

mod bounds;
mod check_image;
mod lifecycle;
mod process;
mod proxy;
mod registry;
