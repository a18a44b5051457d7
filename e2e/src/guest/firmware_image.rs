//! The sample kmod image with firmware: the fleet's sample modules for one kernel
//! (`kmod::build`) plus a firmware file under `/firmware`, pushed to the fleet's
//! registry as `samples/kmm-hello-firmware:<kernel>`, its modules unsigned. The
//! fleet's own samples carry no firmware.

use crate::Result;
use crate::kmod::{self, ImageFile, SampleImage};

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

fn firmware(kernel: &str) -> ImageFile {
    ImageFile {
        path: format!("{}/{FIRMWARE_FILE}", FIRMWARE_PATH.trim_start_matches('/')),
        contents: firmware_contents(kernel),
    }
}
