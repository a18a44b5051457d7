//! The sample kmod image with firmware: the fleet's sample modules for one kernel
//! (`kmod::build`) plus a firmware file under `/firmware`, pushed to the fleet's
//! registry as `samples/kmm-hello-firmware:<kernel>`, its modules unsigned; and the
//! same image with its modules signed with a test key, tagged
//! `<kernel>-signed-<key id>`. The fleet's own samples carry no firmware.

use std::path::Path;

use super::module_signing::{self, TestKey};
use crate::kmod::{self, ImageFile, MODULES, SampleImage};
use crate::{Error, Result};

pub const REPOSITORY: &str = "samples/kmm-hello-firmware";
/// The image's firmware directory (upstream's `firmwarePath`).
pub const FIRMWARE_PATH: &str = "/firmware";
/// The firmware file, relative to [`FIRMWARE_PATH`] and to the host firmware directory.
pub const FIRMWARE_FILE: &str = "kmm/kmm_hello.fw";

/// The firmware's content: fixed, so the guest can compare it byte for byte.
pub fn firmware_contents(kernel: &str) -> Vec<u8> {
    format!("kmm_hello firmware for {kernel}\n").into_bytes()
}

/// Push the image for `kernel` to `registry` (`host:port`, plain HTTP); the pushed
/// reference's tag is the kernel release.
pub async fn push(registry: &str, kernel: &str) -> Result<SampleImage> {
    kmod::push(registry, REPOSITORY, kernel, &[firmware(kernel)]).await
}

/// Push the image for `kernel` with its modules signed with `key` (signed in a copy
/// under `work`). The tag names the key: a run pushes images signed with its own
/// keys, which another run's images must not replace.
pub async fn push_signed(
    registry: &str,
    kernel: &str,
    key: &TestKey,
    work: &Path,
) -> Result<SampleImage> {
    let short_id = key.key_id.get(..16).unwrap_or(&key.key_id);
    let tag = format!("{kernel}-signed-{short_id}");
    let root = kmod::copy_built(kernel, &work.join(&tag))?;
    let signed = module_signing::sign_modules(&root, &key.key, &key.cert)?;
    if signed != MODULES.len() {
        return Err(Error::Invalid(format!(
            "signed {signed} modules below {}, expected the {} sample modules",
            root.display(),
            MODULES.len()
        )));
    }
    kmod::push_root(
        registry,
        REPOSITORY,
        kernel,
        &tag,
        &root,
        &[firmware(kernel)],
    )
    .await
}

fn firmware(kernel: &str) -> ImageFile {
    ImageFile {
        path: format!("{}/{FIRMWARE_FILE}", FIRMWARE_PATH.trim_start_matches('/')),
        contents: firmware_contents(kernel),
    }
}
