//! kmod images as the hub sees them, pure: which images the fleet needs and what it takes
//! to produce each (`need`), and where each stands (`record`): checked against its
//! registry, built, signed, pinned to one digest, or, when the hub cannot check it,
//! pinned per cluster to the digest each cluster resolved (`spoke_pins`). The runtime
//! (`serve::images`) does the I/O and feeds the outcomes back.

pub mod awaited_checks;
pub mod need;
pub mod record;
pub mod spoke_pins;
pub mod status;

pub use need::{ImageKey, ImageNeed, SignPlan, module_needs, unsigned_image_name};
pub use record::{ImageRecord, ImageState, Next, Observation, Verdict};
pub use spoke_pins::{ClusterVerdict, SpokePin, SpokePins};
