//! A module's device plugin Pods over its selected clusters, as its status counts them.
//! Pure.

use kmm_api::{ClusterDevicePlugins, DevicePluginCounts};

/// The status entries of at most this many clusters short of plugin Pods.
pub const MAX_SHORT_CLUSTERS: usize = 10;

/// Totals of each cluster's (desired, available) plugin Pods, and the first clusters by
/// name where fewer are available than desired.
pub fn counts<'a>(clusters: impl IntoIterator<Item = (&'a str, (u32, u32))>) -> DevicePluginCounts {
    let mut all: Vec<(&str, (u32, u32))> = clusters.into_iter().collect();
    all.sort_unstable_by_key(|(cluster, _)| *cluster);
    let number = |n: u32| i32::try_from(n).unwrap_or(i32::MAX);
    let mut counts = DevicePluginCounts::default();
    for (cluster, (desired, available)) in all {
        counts.desired = counts.desired.saturating_add(number(desired));
        counts.available = counts.available.saturating_add(number(available));
        if available < desired && counts.short.len() < MAX_SHORT_CLUSTERS {
            counts.short.push(ClusterDevicePlugins {
                cluster: cluster.to_owned(),
                desired: number(desired),
                available: number(available),
            });
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_and_the_clusters_short_of_pods_by_name() {
        let names: Vec<String> = (0..15).map(|i| format!("c{i:02}")).collect();
        let clusters = names
            .iter()
            .enumerate()
            .map(|(i, name)| (name.as_str(), (2, if i % 2 == 0 { 2 } else { 1 })));
        let counted = counts(clusters);
        assert_eq!((counted.desired, counted.available), (30, 23));
        assert_eq!(counted.short.len(), 7);
        assert_eq!(counted.short[0].cluster, "c01");
        assert_eq!(
            (counted.short[0].desired, counted.short[0].available),
            (2, 1)
        );
        let many = names.iter().map(|name| (name.as_str(), (1, 0)));
        assert_eq!(counts(many).short.len(), MAX_SHORT_CLUSTERS);
        assert_eq!(counts(std::iter::empty()), DevicePluginCounts::default());
    }
}
