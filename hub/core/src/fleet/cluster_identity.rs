//! Which managed cluster a spoke proxy speaks for, from the subject of its client
//! certificate as OCM's add-on registration issues it. Never from a message field.

use thiserror::Error;

/// A spoke proxy's identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterIdentity {
    /// The ManagedCluster's name.
    pub cluster: String,
    /// The add-on agent's name within that cluster.
    pub agent: String,
}

/// Why a certificate subject is not a kmm add-on agent's.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error(
    "client certificate common name {common_name:?} is not an agent's of add-on {addon}: {reason}"
)]
pub struct IdentityError {
    common_name: String,
    addon: String,
    reason: &'static str,
}

impl ClusterIdentity {
    /// Parses `system:open-cluster-management:cluster:<cluster>:addon:<addon>:agent:<agent>`
    /// for the add-on `addon` (`kmm` as `clusteradm addon enable --names kmm` registers it).
    pub fn from_common_name(common_name: &str, addon: &str) -> Result<Self, IdentityError> {
        let fail = |reason| IdentityError {
            common_name: common_name.to_owned(),
            addon: addon.to_owned(),
            reason,
        };
        let rest = common_name
            .strip_prefix("system:open-cluster-management:cluster:")
            .ok_or_else(|| {
                fail("it does not start with system:open-cluster-management:cluster:")
            })?;
        let (cluster, rest) = rest
            .split_once(':')
            .ok_or_else(|| fail("it names no add-on"))?;
        let agent = rest
            .strip_prefix("addon:")
            .and_then(|r| r.strip_prefix(addon))
            .and_then(|r| r.strip_prefix(":agent:"))
            .ok_or_else(|| fail("it is not for this add-on's agent"))?;
        if !is_dns_subdomain(cluster) {
            return Err(fail("the cluster name is not a valid ManagedCluster name"));
        }
        if agent.is_empty() || agent.contains(':') {
            return Err(fail("the agent name is empty or contains ':'"));
        }
        Ok(Self {
            cluster: cluster.to_owned(),
            agent: agent.to_owned(),
        })
    }
}

/// Whether `name` is a DNS subdomain (RFC 1123), as the names of most Kubernetes objects
/// must be.
pub(crate) fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_add_on_name_is_the_hubs() {
        let cn =
            "system:open-cluster-management:cluster:spoke2:addon:kmm-test:agent:kmm-test-agent";
        let id = ClusterIdentity::from_common_name(cn, "kmm-test").unwrap();
        assert_eq!(id.cluster, "spoke2");
        let error = ClusterIdentity::from_common_name(cn, "kmm").unwrap_err();
        assert!(error.to_string().contains("add-on kmm:"), "{error}");
    }

    #[test]
    fn ocm_issued_subject_names_the_cluster() {
        let id = ClusterIdentity::from_common_name(
            "system:open-cluster-management:cluster:spoke1:addon:kmm:agent:kmm-agent",
            "kmm",
        )
        .unwrap();
        assert_eq!(
            id,
            ClusterIdentity {
                cluster: "spoke1".into(),
                agent: "kmm-agent".into()
            }
        );
    }

    #[test]
    fn other_subjects_are_refused() {
        for cn in [
            "",
            "spoke1",
            "system:open-cluster-management:cluster:spoke1:agent",
            "system:open-cluster-management:cluster:spoke1:addon:other:agent:a",
            "system:open-cluster-management:cluster:spoke1:addon:kmmx:agent:a",
            "system:open-cluster-management:cluster:Spoke_1:addon:kmm:agent:a",
            "system:open-cluster-management:cluster:spoke1:addon:kmm:agent:",
            "system:open-cluster-management:cluster:spoke1:addon:kmm:agent:a:b",
            "system:serviceaccount:default:kmm",
            "system:open-cluster-management:cluster:spoke1:addon:kmm-test:agent:a",
        ] {
            assert!(
                ClusterIdentity::from_common_name(cn, "kmm").is_err(),
                "{cn:?} was accepted"
            );
        }
    }
}
