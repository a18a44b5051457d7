//! Properties of parsing and substitution that must hold for any input.

use std::collections::BTreeMap;

use kmm_resolver::{KERNEL_VARIABLES, KernelRelease, template};
use proptest::prelude::*;

fn escape(text: &str) -> String {
    text.replace('$', "$$")
}

proptest! {
    #[test]
    fn any_release_parses_and_defines_the_full_version(release in "\\PC{0,80}") {
        let kernel = KernelRelease::parse(&release);
        let normalized = release.strip_suffix('+').unwrap_or(&release);
        prop_assert_eq!(kernel.normalized(), normalized);
        prop_assert_eq!(&kernel.variables()["KERNEL_FULL_VERSION"], normalized);
        for name in kernel.variables().keys() {
            prop_assert!(KERNEL_VARIABLES.contains(name), "undocumented variable {}", name);
        }
    }

    #[test]
    fn structured_releases_define_xyz(x in 0u32..100, y in 0u32..100, z in 0u32..1000, rest in "(-[a-z0-9.]{1,20})?") {
        let kernel = KernelRelease::parse(&format!("{x}.{y}.{z}{rest}"));
        prop_assert_eq!(&kernel.variables()["KERNEL_XYZ"], &format!("{x}.{y}.{z}"));
        prop_assert_eq!(&kernel.variables()["KERNEL_Z"], &z.to_string());
    }

    #[test]
    fn escaped_text_expands_to_itself(text in "\\PC{0,60}") {
        let out = template::expand(&escape(&text), &BTreeMap::new(), &mut BTreeMap::new());
        prop_assert_eq!(out.unwrap(), text);
    }

    #[test]
    fn substitution_inserts_values_verbatim(
        prefix in "[a-z/:.]{0,10}", value in "[a-z0-9.$-]{0,20}", suffix in "[a-z/:.-]{0,10}"
    ) {
        let vars = BTreeMap::from([("KERNEL_X", value.clone())]);
        let mut used = BTreeMap::new();
        let template = format!("{}${{KERNEL_X}}{}", escape(&prefix), escape(&suffix));
        let out = template::expand(&template, &vars, &mut used).unwrap();
        prop_assert_eq!(out, format!("{prefix}{value}{suffix}"));
        prop_assert_eq!(used.len(), 1);
    }

    #[test]
    fn expansion_never_panics(text in "\\PC{0,60}") {
        let vars = BTreeMap::from([("A", "1".to_string())]);
        let _ = template::expand(&text, &vars, &mut BTreeMap::new());
        let _ = template::references(&text);
    }
}
