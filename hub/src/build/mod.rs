//! kmod image builds, run by the hub as Kubernetes Jobs with the builder image the project
//! ships (buildah, `hub/builder/`). This module is HOW a build runs; the image pipeline
//! decides WHEN (the image is missing from its registry, backoff after a failure).
//!
//! * [`request`]: what a build is made of and the fingerprint identifying it (pure);
//! * [`job`]: the Job and the inputs it mounts (pure);
//! * [`jobs`]: creating, following and deleting the Jobs on the hub cluster.

pub mod job;
pub mod jobs;
pub mod request;

pub use job::builds_namespace;
pub use jobs::{BuildError, BuildJobs, BuildProgress};
pub use request::BuildRequest;
