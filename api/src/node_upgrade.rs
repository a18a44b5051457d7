//! How a change of a module's version moves through each cluster's nodes: at most
//! `maxUnavailable` matching nodes without the module at once. The parsing and rounding
//! live here so that admission, the hub and the spoke proxy agree on them.

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

/// How a version change moves through each cluster's nodes.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeUpgrade {
    /// Most matching nodes of one cluster that may be without the module at once while
    /// its version changes: a number of nodes (at least 1) or a percentage of the
    /// cluster's matching nodes (`1%` to `100%`, rounded up). Nodes that already lack the
    /// module (failed, rebooting) count against it. Absent: every node at once.
    pub max_unavailable: Option<IntOrString>,
}

/// `maxUnavailable`, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaxUnavailable {
    /// At most this many nodes.
    Nodes(u32),
    /// At most this percentage of the matching nodes, rounded up.
    Percent(u32),
}

impl MaxUnavailable {
    /// Reads `maxUnavailable`; the error says what is wrong with the value.
    pub fn parse(value: &IntOrString) -> Result<Self, String> {
        match value {
            IntOrString::Int(n) if *n >= 1 => Ok(Self::Nodes(n.unsigned_abs())),
            IntOrString::Int(_) => Err("must be at least 1 node".to_owned()),
            IntOrString::String(s) => {
                let percent = crate::percent::percent(s).ok_or_else(|| {
                    "must be a number of nodes or a percentage such as \"25%\"".to_owned()
                })?;
                if (1..=100).contains(&percent) {
                    Ok(Self::Percent(percent))
                } else {
                    Err("a percentage must be between 1% and 100%".to_owned())
                }
            }
        }
    }

    /// How many of `matching` nodes may be without the module at once; never 0, so that
    /// an upgrade always moves.
    pub fn nodes_of(self, matching: usize) -> usize {
        match self {
            Self::Nodes(n) => n as usize,
            Self::Percent(p) => (matching * p as usize).div_ceil(100),
        }
        .max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(value: IntOrString) -> Result<MaxUnavailable, String> {
        MaxUnavailable::parse(&value)
    }

    #[test]
    fn numbers_and_percentages_parse() {
        assert_eq!(parse(IntOrString::Int(1)), Ok(MaxUnavailable::Nodes(1)));
        assert_eq!(
            parse(IntOrString::String("25%".into())),
            Ok(MaxUnavailable::Percent(25))
        );
        assert_eq!(
            parse(IntOrString::String("100%".into())),
            Ok(MaxUnavailable::Percent(100))
        );
    }

    #[test]
    fn nothing_at_most_zero_or_out_of_range_parses() {
        for bad in [
            IntOrString::Int(0),
            IntOrString::Int(-1),
            IntOrString::String("0%".into()),
            IntOrString::String("101%".into()),
            IntOrString::String("-5%".into()),
            IntOrString::String("+5%".into()),
            IntOrString::String("05%".into()),
            IntOrString::String("5".into()),
            IntOrString::String("%".into()),
            IntOrString::String("half".into()),
        ] {
            assert!(parse(bad.clone()).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn percentages_round_up_and_never_reach_zero() {
        assert_eq!(MaxUnavailable::Percent(25).nodes_of(3), 1);
        assert_eq!(MaxUnavailable::Percent(34).nodes_of(3), 2);
        assert_eq!(MaxUnavailable::Percent(100).nodes_of(7), 7);
        assert_eq!(MaxUnavailable::Percent(1).nodes_of(0), 1);
        assert_eq!(MaxUnavailable::Nodes(2).nodes_of(1), 2);
    }
}
