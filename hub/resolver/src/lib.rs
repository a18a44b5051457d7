//! The kernel-mapping engine: for one module and one kernel, what a node must load.
//!
//! Pure: no I/O, no async, no clock. The hub calls it for every kernel its spoke clusters
//! report; `kmm-hub render` calls it for kernels a user names; the admission webhook calls
//! [`validate`] alone. Semantics follow upstream Kernel Module Management (mapping order,
//! merge rules, variables) except where upstream is silently lenient: an undefined variable
//! or an unpinned image is an error here, never an empty string or `:latest`.

pub mod go_regexp;
pub mod image_reference;
pub mod kernel;
pub mod merge;
mod resolve;
pub mod template;
mod validation;

pub use kernel::{KERNEL_VARIABLES, KernelRelease};
pub use resolve::{MatchedBy, Resolution, ResolveError, ResolveErrorKind, Resolver};
pub use validation::{FieldError, MODULE_VARIABLES, ModuleIdentity, ValidationErrors, validate};
