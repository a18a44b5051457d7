//! Service link variables, as the kubelet builds them (`getServiceEnvVarMap` and
//! `pkg/kubelet/envvars`): for every Service with a cluster IP in the pod's namespace
//! (when the pod's `enableServiceLinks` is true, its default) and, always, the
//! `kubernetes` Service of `default`. A Service of the pod's own namespace named
//! `kubernetes` wins over the one of `default`. Pure.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Service;

const DEFAULT_NAMESPACE: &str = "default";
/// The apiserver's own Service, whose variables in-cluster clients read.
const MASTER_SERVICE: &str = "kubernetes";

/// The variables for a pod of `namespace` given the cluster's Services (any
/// namespace; those the kubelet would not project are ignored).
pub(super) fn service_env(
    namespace: &str,
    enable_service_links: bool,
    services: &[Service],
) -> BTreeMap<String, String> {
    let mut chosen: BTreeMap<&str, &Service> = BTreeMap::new();
    for service in services.iter().filter(|s| cluster_ip(s).is_some()) {
        let Some(name) = service.metadata.name.as_deref() else {
            continue;
        };
        let service_namespace = service.metadata.namespace.as_deref().unwrap_or_default();
        if service_namespace == DEFAULT_NAMESPACE && name == MASTER_SERVICE {
            chosen.entry(name).or_insert(service);
        } else if service_namespace == namespace && enable_service_links {
            chosen.insert(name, service);
        }
    }
    let mut env = BTreeMap::new();
    for (name, service) in chosen {
        link_variables(name, service, &mut env);
    }
    env
}

/// The cluster IP, unless the Service has none (headless or `ExternalName`).
fn cluster_ip(service: &Service) -> Option<&str> {
    service
        .spec
        .as_ref()
        .and_then(|s| s.cluster_ip.as_deref())
        .filter(|ip| !ip.is_empty() && *ip != "None")
}

fn link_variables(name: &str, service: &Service, env: &mut BTreeMap<String, String>) {
    let (Some(ip), Some(ports)) = (
        cluster_ip(service),
        service.spec.as_ref().and_then(|s| s.ports.as_deref()),
    ) else {
        return;
    };
    // Validation requires a port on a Service with a cluster IP; the kubelet would
    // crash on one without, the runner skips it.
    let Some(first) = ports.first() else {
        return;
    };
    let prefix = variable_name(name);
    env.insert(format!("{prefix}_SERVICE_HOST"), ip.to_owned());
    env.insert(format!("{prefix}_SERVICE_PORT"), first.port.to_string());
    for port in ports {
        if let Some(port_name) = port.name.as_deref().filter(|n| !n.is_empty()) {
            env.insert(
                format!("{prefix}_SERVICE_PORT_{}", variable_name(port_name)),
                port.port.to_string(),
            );
        }
    }
    // Docker's link variables.
    for (i, port) in ports.iter().enumerate() {
        let protocol = port.protocol.as_deref().unwrap_or("TCP");
        let lower = protocol.to_lowercase();
        let url = format!("{lower}://{}", join_host_port(ip, port.port));
        if i == 0 {
            env.insert(format!("{prefix}_PORT"), url.clone());
        }
        let port_prefix = format!("{prefix}_PORT_{}_{}", port.port, protocol.to_uppercase());
        env.insert(format!("{port_prefix}_PROTO"), lower);
        env.insert(format!("{port_prefix}_PORT"), port.port.to_string());
        env.insert(format!("{port_prefix}_ADDR"), ip.to_owned());
        env.insert(port_prefix, url);
    }
}

/// Upper case, `-` to `_` (the kubelet's `makeEnvVariableName`).
fn variable_name(name: &str) -> String {
    name.replace('-', "_").to_uppercase()
}

/// Go's `net.JoinHostPort`: brackets around an IPv6 address.
fn join_host_port(host: &str, port: i32) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};
    use kube::api::ObjectMeta;

    use super::*;

    fn service(
        namespace: &str,
        name: &str,
        ip: &str,
        ports: &[(Option<&str>, i32, Option<&str>)],
    ) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some(ip.into()),
                ports: Some(
                    ports
                        .iter()
                        .map(|(name, port, protocol)| ServicePort {
                            name: name.map(Into::into),
                            port: *port,
                            protocol: protocol.map(Into::into),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn kubernetes() -> Service {
        service(
            "default",
            "kubernetes",
            "10.96.0.1",
            &[(Some("https"), 443, Some("TCP"))],
        )
    }

    fn pairs(env: &BTreeMap<String, String>) -> Vec<(&str, &str)> {
        env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
    }

    #[test]
    fn the_kubernetes_service_as_every_pod_sees_it() {
        let env = service_env("kmm", true, &[kubernetes()]);
        assert_eq!(
            pairs(&env),
            [
                ("KUBERNETES_PORT", "tcp://10.96.0.1:443"),
                ("KUBERNETES_PORT_443_TCP", "tcp://10.96.0.1:443"),
                ("KUBERNETES_PORT_443_TCP_ADDR", "10.96.0.1"),
                ("KUBERNETES_PORT_443_TCP_PORT", "443"),
                ("KUBERNETES_PORT_443_TCP_PROTO", "tcp"),
                ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
                ("KUBERNETES_SERVICE_PORT", "443"),
                ("KUBERNETES_SERVICE_PORT_HTTPS", "443"),
            ]
        );
    }

    #[test]
    fn every_port_and_named_port_of_a_namespace_service() {
        let proxy = service(
            "kmm",
            "kmm-spoke-proxy",
            "10.96.3.4",
            &[
                (None, 8443, None),
                (Some("metrics-http"), 9090, Some("TCP")),
                (Some("dns"), 53, Some("UDP")),
            ],
        );
        let env = service_env("kmm", true, &[proxy]);
        assert_eq!(
            pairs(&env),
            [
                ("KMM_SPOKE_PROXY_PORT", "tcp://10.96.3.4:8443"),
                ("KMM_SPOKE_PROXY_PORT_53_UDP", "udp://10.96.3.4:53"),
                ("KMM_SPOKE_PROXY_PORT_53_UDP_ADDR", "10.96.3.4"),
                ("KMM_SPOKE_PROXY_PORT_53_UDP_PORT", "53"),
                ("KMM_SPOKE_PROXY_PORT_53_UDP_PROTO", "udp"),
                ("KMM_SPOKE_PROXY_PORT_8443_TCP", "tcp://10.96.3.4:8443"),
                ("KMM_SPOKE_PROXY_PORT_8443_TCP_ADDR", "10.96.3.4"),
                ("KMM_SPOKE_PROXY_PORT_8443_TCP_PORT", "8443"),
                ("KMM_SPOKE_PROXY_PORT_8443_TCP_PROTO", "tcp"),
                ("KMM_SPOKE_PROXY_PORT_9090_TCP", "tcp://10.96.3.4:9090"),
                ("KMM_SPOKE_PROXY_PORT_9090_TCP_ADDR", "10.96.3.4"),
                ("KMM_SPOKE_PROXY_PORT_9090_TCP_PORT", "9090"),
                ("KMM_SPOKE_PROXY_PORT_9090_TCP_PROTO", "tcp"),
                ("KMM_SPOKE_PROXY_SERVICE_HOST", "10.96.3.4"),
                ("KMM_SPOKE_PROXY_SERVICE_PORT", "8443"),
                ("KMM_SPOKE_PROXY_SERVICE_PORT_DNS", "53"),
                ("KMM_SPOKE_PROXY_SERVICE_PORT_METRICS_HTTP", "9090"),
            ]
        );
    }

    #[test]
    fn only_the_pods_namespace_and_the_master_service() {
        let services = [
            kubernetes(),
            service("kmm", "agent", "10.96.0.10", &[(None, 80, None)]),
            service("other", "elsewhere", "10.96.0.11", &[(None, 80, None)]),
            service("default", "not-master", "10.96.0.12", &[(None, 80, None)]),
        ];
        let env = service_env("kmm", true, &services);
        assert!(env.contains_key("AGENT_SERVICE_HOST"));
        assert!(env.contains_key("KUBERNETES_SERVICE_HOST"));
        assert!(!env.contains_key("ELSEWHERE_SERVICE_HOST"));
        assert!(!env.contains_key("NOT_MASTER_SERVICE_HOST"));

        let in_default = service_env("default", true, &services);
        assert!(in_default.contains_key("NOT_MASTER_SERVICE_HOST"));
        assert!(in_default.contains_key("KUBERNETES_SERVICE_HOST"));
        assert!(!in_default.contains_key("AGENT_SERVICE_HOST"));
    }

    #[test]
    fn without_service_links_only_the_master_service() {
        let services = [
            kubernetes(),
            service("kmm", "agent", "10.96.0.10", &[(None, 80, None)]),
        ];
        let env = service_env("kmm", false, &services);
        assert!(env.keys().all(|k| k.starts_with("KUBERNETES_")), "{env:?}");
        assert_eq!(env["KUBERNETES_SERVICE_HOST"], "10.96.0.1");
    }

    #[test]
    fn a_namespace_service_named_kubernetes_wins_whatever_the_order() {
        let own = service("kmm", "kubernetes", "10.96.9.9", &[(None, 6443, None)]);
        for services in [[kubernetes(), own.clone()], [own.clone(), kubernetes()]] {
            let env = service_env("kmm", true, &services);
            assert_eq!(env["KUBERNETES_SERVICE_HOST"], "10.96.9.9");
            assert_eq!(env["KUBERNETES_SERVICE_PORT"], "6443");
            assert!(!env.contains_key("KUBERNETES_SERVICE_PORT_HTTPS"));
        }
        // With links off, the pod's own `kubernetes` is not projected.
        let env = service_env("kmm", false, &[own, kubernetes()]);
        assert_eq!(env["KUBERNETES_SERVICE_HOST"], "10.96.0.1");
    }

    #[test]
    fn services_without_a_cluster_ip_or_ports_are_ignored() {
        let mut no_spec = kubernetes();
        no_spec.spec = None;
        let services = [
            service("kmm", "headless", "None", &[(None, 80, None)]),
            service("kmm", "external", "", &[(None, 80, None)]),
            service("kmm", "portless", "10.96.0.20", &[]),
            no_spec,
        ];
        assert!(service_env("kmm", true, &services).is_empty());
    }

    #[test]
    fn ipv6_addresses_are_bracketed_in_urls() {
        let v6 = service("kmm", "six", "fd00::10", &[(None, 443, Some("SCTP"))]);
        let env = service_env("kmm", true, &[v6]);
        assert_eq!(env["SIX_PORT"], "sctp://[fd00::10]:443");
        assert_eq!(env["SIX_PORT_443_SCTP_ADDR"], "fd00::10");
        assert_eq!(env["SIX_SERVICE_HOST"], "fd00::10");
    }
}
