//! Node labels that tell workloads a module is loaded (upstream KMM's label contract).

/// Prefix of every label kmm-fleet sets on nodes.
pub const NODE_LABEL_DOMAIN: &str = "kmm.node.kubernetes.io";

/// Longest `namespace + name` a module may have. Same bound as upstream KMM, whose
/// longest node label for a module must stay within the 63-character name segment of a
/// label key; an MCM valid here is therefore valid upstream too.
pub const MAX_COMBINED_NAME_LENGTH: usize = 41;

/// `kmm.node.kubernetes.io/<namespace>.<name>.ready`: set once the module is loaded.
pub fn ready_label(namespace: &str, name: &str) -> String {
    format!("{NODE_LABEL_DOMAIN}/{namespace}.{name}.ready")
}

/// `kmm.node.kubernetes.io/<namespace>.<name>.version.ready`: the loaded module's version.
pub fn version_ready_label(namespace: &str, name: &str) -> String {
    format!("{NODE_LABEL_DOMAIN}/{namespace}.{name}.version.ready")
}

/// `kmm.node.kubernetes.io/<namespace>.<name>.device-plugin-ready`: the module's device
/// plugin Pod on the node is Ready (upstream's meaning: workloads wait for it). Removed
/// once the Pod stops being Ready or goes, and as soon as the plugin is to stop there.
pub fn device_plugin_ready_label(namespace: &str, name: &str) -> String {
    format!("{NODE_LABEL_DOMAIN}/{namespace}.{name}.device-plugin-ready")
}

/// Prefix of the node label kmm-fleet schedules device plugins with: its own, not part of
/// upstream's contract, so that nobody mistakes it for a sign the plugin runs.
pub const DEVICE_PLUGIN_SCHEDULING_DOMAIN: &str = "device-plugin.kmm.sigs.x-k8s.io";

/// `device-plugin.kmm.sigs.x-k8s.io/<namespace>.<name>`: the module's device plugin is to
/// run on the node (the module runs there at the version it is to run, with no unload or
/// version change coming; or, for a module that loads nothing, the node is selected).
/// The plugin's DaemonSet selects the nodes carrying it.
pub fn device_plugin_scheduling_label(namespace: &str, name: &str) -> String {
    format!("{DEVICE_PLUGIN_SCHEDULING_DOMAIN}/{namespace}.{name}")
}

/// `kmm.node.kubernetes.io/version-module.<namespace>.<name>`: set by users who move nodes
/// to a new version one by one themselves (upstream's ordered upgrade). A node carrying it
/// runs only the version it names.
pub fn version_module_label(namespace: &str, name: &str) -> String {
    format!("{NODE_LABEL_DOMAIN}/version-module.{namespace}.{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_follow_upstream_format() {
        assert_eq!(
            ready_label("ns", "mod"),
            "kmm.node.kubernetes.io/ns.mod.ready"
        );
        assert_eq!(
            version_ready_label("ns", "mod"),
            "kmm.node.kubernetes.io/ns.mod.version.ready"
        );
        assert_eq!(
            version_module_label("ns", "mod"),
            "kmm.node.kubernetes.io/version-module.ns.mod"
        );
        assert_eq!(
            device_plugin_ready_label("ns", "mod"),
            "kmm.node.kubernetes.io/ns.mod.device-plugin-ready"
        );
        assert_eq!(
            device_plugin_scheduling_label("ns", "mod"),
            "device-plugin.kmm.sigs.x-k8s.io/ns.mod"
        );
    }

    #[test]
    fn longest_allowed_names_fit_a_label_key() {
        let namespace = "n".repeat(20);
        let name = "m".repeat(MAX_COMBINED_NAME_LENGTH - 20);
        for label in [
            ready_label(&namespace, &name),
            version_ready_label(&namespace, &name),
            version_module_label(&namespace, &name),
            device_plugin_ready_label(&namespace, &name),
        ] {
            let (_, key_name) = label.split_once('/').expect("label has a prefix");
            assert!(
                key_name.len() <= 63,
                "{label} has a name segment over 63 characters"
            );
        }
    }

    #[test]
    fn the_scheduling_label_is_a_valid_key_for_the_longest_names() {
        let namespace = "n".repeat(20);
        let name = "m".repeat(MAX_COMBINED_NAME_LENGTH - 20);
        let label = device_plugin_scheduling_label(&namespace, &name);
        let (prefix, key_name) = label.split_once('/').expect("label has a prefix");
        assert!(prefix.len() <= 253, "{prefix}");
        assert!(
            prefix.split('.').all(|part| !part.is_empty()
                && part.len() <= 63
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')),
            "{prefix} is not a DNS subdomain"
        );
        assert!(
            key_name.len() <= 63,
            "{label} has a name segment over 63 characters"
        );
        assert_eq!(key_name, format!("{namespace}.{name}"));
    }
}
