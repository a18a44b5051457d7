//! Kernel release parsing and template substitution on arbitrary input: never a panic, and
//! a successful expansion only ever uses variables the kernel defines.

#![no_main]

use std::collections::BTreeMap;

use kmm_resolver::{KernelRelease, template};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (release, template_text) = text.split_once('\n').unwrap_or((text, text));
    let kernel = KernelRelease::parse(release);
    assert_eq!(
        kernel.variables()["KERNEL_FULL_VERSION"],
        kernel.normalized()
    );
    let mut used = BTreeMap::new();
    if template::expand(template_text, kernel.variables(), &mut used).is_ok() {
        for (name, value) in &used {
            assert_eq!(kernel.variables().get(name.as_str()), Some(value));
        }
        let referenced = template::references(template_text).expect("expanded, so it parses");
        assert_eq!(referenced.len(), used.len());
    }
});
