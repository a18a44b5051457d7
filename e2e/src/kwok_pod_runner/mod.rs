//! `kwok-pod-runner`: a stand-in kubelet for a spoke's KWOK nodes.
//!
//! KWOK makes simulated nodes look Ready and marks the pods bound to them Running with
//! an IP from its range, but runs nothing. The runner makes the selected pods on those
//! nodes real: for each it starts the container's program as a host process with the
//! command, arguments, environment and mounted files taken from the Pod, so that
//! whatever the cluster applies (the node agent's DaemonSet, through OCM) is what runs,
//! not a hand-written command line. It is the only simulated part of the deployment.
//! One runner serves one cluster.
//!
//! # Design
//!
//! * Reflectors keep the selected Pods (namespace and label selector), the Nodes and
//!   the namespace's ConfigMaps in memory. On every Pod or Node change the runner
//!   works out which pods are its own ([`selection`]: bound to a node carrying the
//!   KWOK annotation, not terminating, with a pod IP) and starts or stops one
//!   supervisor per pod UID ([`supervisor`]). A pod that is deleted, gets a
//!   `deletionTimestamp` or is replaced (same name, new UID) is stopped; a new pod on a
//!   node waits until that node's stopping pods are gone, as a DaemonSet's successor
//!   would (KWOK deletes a pod at once, where a kubelet would first stop it).
//! * A supervisor waits, like the kubelet, for the pod's inputs (a non-optional
//!   ConfigMap, a required hostPath, the tokens), writes the volumes' files
//!   ([`volumes`], [`tokens`]), adds the pod IP ([`address`]), builds each container's
//!   process ([`container`]: Downward API [`fields`], Service link variables
//!   [`service_env`], `$(VAR)` [`expansion`], [`paths`]) and starts it ([`child`]).
//!   It restarts an exited process with the kubelet's kind of backoff (1 s doubling to
//!   30 s, reset after 60 s of running), keeps token and ConfigMap files current, and
//!   stops the pod with SIGTERM, its `terminationGracePeriodSeconds` (at most 30 s)
//!   and SIGKILL; what a process forked is killed with it.
//! * Every process runs in the network namespace of the cluster's first real node
//!   (`--netns`), where kube-proxy programs the Service ClusterIPs, with the pod's IP on
//!   an interface of the runner's (`--address-interface`) so it can bind to it. A
//!   container's process cannot outlive the runner (parent-death signal); on SIGTERM
//!   or SIGINT the runner stops every pod, removes that interface and exits.
//! * The runner writes nothing to the API but TokenRequests: pod status stays KWOK's.
//!
//! # On disk
//!
//! ```text
//! <root>/status.json                      the runner's view (see `Status`)
//! <root>/<node>/powered-off               the power switch (created by tests)
//! <root>/<node>/host/<path>               hostPath volumes: the node's own /run, /var/lib, ...
//! <root>/<node>/pods/<uid>/               working directory of the pod's processes
//! <root>/<node>/pods/<uid>/volumes/<vol>/ emptyDir, configMap, downwardAPI, projected
//! <logs>/<namespace>_<pod>_<container>.log stdout and stderr, appended across restarts
//! ```
//!
//! A pod's directory is removed when it stops; the host directories stay, as a node's
//! disk does.
//!
//! # Power switch
//!
//! While the file `<root>/<node>/powered-off` exists, the node has lost power: its
//! processes are killed with SIGKILL (no SIGTERM, no grace), its pod IPs removed, and
//! nothing starts on it. The runner looks every 500 ms. Once the file is removed,
//! every container of the node's pods starts at once (no backoff) and its restart
//! count grows, as after a reboot; the host directories kept their contents.
//!
//! # Differences from a kubelet
//!
//! * **Paths.** There is no container filesystem: a process sees the host's. Every
//!   volume mount's `mountPath` is therefore rewritten to the host directory (or file)
//!   that stands for it, in the command, the arguments and the environment values,
//!   after `$(VAR)` expansion. Only whole path prefixes are rewritten: the `mountPath`
//!   must start the string or follow `=`, `:`, `,` or a space, and end the string or be
//!   followed by `/`; the longest `mountPath` wins. So
//!   `--token-file=/var/run/secrets/kmm/token` becomes
//!   `--token-file=<root>/<node>/pods/<uid>/volumes/<vol>/token`. Paths a program
//!   builds in itself (a client library's default token path) are not rewritten: pass
//!   them as flags or environment values. A `workingDir` must be on a mount.
//! * **Programs.** No image is pulled: `--program IMAGE_PATH=HOST_PATH` maps a
//!   container's `command[0]` to a host binary; a container without `command` or with
//!   an unmapped one refuses its pod (logged, `refused` in `status.json`).
//! * **Secrets** are never written to disk: Secret volumes and Secret projections are
//!   left out and their mounts dropped (logged once per pod); `secretKeyRef`,
//!   `configMapKeyRef`, `resourceFieldRef` and `envFrom` refuse the pod, as do init
//!   containers, `subPath` mounts and volume types other than emptyDir, hostPath,
//!   configMap, downwardAPI and projected.
//! * **Isolation.** Processes run as the runner's user, in the host's mount and PID
//!   namespaces, and all KWOK nodes of the cluster share one network namespace: two
//!   pods listening on the same port must bind to their pod IPs. No cgroups, limits,
//!   probes, security contexts or file modes.
//! * **Environment.** The kubelet's variables (container `env` with `value` and
//!   `fieldRef`, Service links computed when the process starts) plus the runner's own
//!   `PATH`, nothing else from the host; `status.hostIP` is the pod's (KWOK's).
//! * **Stopping.** The grace period is always the pod's `terminationGracePeriodSeconds`
//!   (at most 30 s), never a deletion's own: KWOK deletes every terminating pod again
//!   with a grace period of 0.
//! * **Timing.** ConfigMap changes reach the files within 500 ms (a kubelet may take a
//!   minute).

mod address;
mod child;
mod container;
mod expansion;
mod fields;
mod files;
mod paths;
mod selection;
mod service_env;
mod status;
mod tokens;
mod volumes;

pub use child::Exec;
pub use status::{ContainerStatus, State, Status};
