//! The kmm-fleet hub's pure core: what each cluster must run ([`fleet`]), the images
//! modules need and their records ([`images`]), the modules' per-kernel resolutions
//! ([`resolutions`]), and the clusters' sessions ([`sessions`], [`outbound`]). No I/O and
//! no Kubernetes client: the hub's runtime (`kmm-hub`) feeds it watched objects and
//! stream messages and ships its answers, and the fuzz targets drive it directly.

pub mod fleet;
pub mod images;
pub mod outbound;
pub mod resolutions;
pub mod sessions;
