//! The gRPC contract between the three kmm-fleet binaries, package `kmm.v1`:
//!
//! - [`v1::hub_server`] / [`v1::hub_client`]: one stream per managed cluster, spoke proxy to hub;
//! - [`v1::agent_server`] / [`v1::agent_client`]: one stream per node, node agent to spoke proxy.
//!
//! The `.proto` sources under `proto/kmm/v1/` are the documentation of every message.

pub mod codec;

/// `ModuleNodeStatus.reason` of a module sharing a kernel module with another module of
/// the node (see `hub.proto`): set by the proxy, shown by the hub, never a failure.
pub const REASON_KERNEL_MODULE_SHARED: &str = "KernelModuleShared";

/// Largest messages each side accepts, part of the contract: a peer sending more gets
/// `RESOURCE_EXHAUSTED`, never an unbounded allocation on the receiving side. Sizes are of
/// the encoded message.
pub mod limits {
    /// Proxy to hub (`ProxyMessage`): a hello, an inventory, or one part of a node status
    /// report (see [`crate::report_parts`]).
    pub const PROXY_MESSAGE: usize = 4 << 20;
    /// The size a node status report's parts are cut to: well below
    /// [`PROXY_MESSAGE`], so that a part stays valid whatever its last entry weighs
    /// (an agent's error text is bounded far below the difference). Small, because the
    /// hub's decode buffer of every stream is sized for three parts
    /// ([`crate::codec::DECODE_BUFFER`]) and tonic keeps a buffer as large as it ever
    /// grew: heaptrack measured 85 KiB per stream with 1 MiB parts, 35 KiB with 16 KiB
    /// parts and 32 KiB with 8 KiB parts sent in 32 KiB chunks.
    pub const REPORT_PART: usize = 2 << 10;
    /// Hub to proxy (`HubMessage`): a cluster's complete intents with credentials.
    pub const HUB_MESSAGE: usize = 64 << 20;
    /// Agent to proxy (`AgentMessage`): a hello or one event.
    pub const AGENT_MESSAGE: usize = 1 << 20;
    /// Proxy to agent (`AgentInstruction`): one node's desired modules.
    pub const AGENT_INSTRUCTION: usize = 16 << 20;
    /// The bytes of `ProxyHello.applied_intent_digest` when not empty: a SHA-256.
    pub const INTENT_DIGEST: usize = 32;
    /// The highest intent revision a peer may name. Revisions grow by one per snapshot a
    /// cluster is sent: at one a millisecond this lasts 285,000 years, so a peer naming
    /// more is broken or hostile, and the hub's next revision can never overflow.
    pub const MAX_INTENT_REVISION: u64 = 1 << 53;
    /// The longest kernel release a peer may name (`KernelInventory`): Linux's
    /// `utsname.release` holds at most 64 bytes.
    pub const KERNEL_RELEASE: usize = 64;
    /// The most distinct kernels one cluster's inventory may name. Every kernel is
    /// resolved for every module and may become an image to check, so a cluster naming
    /// more is refused rather than allowed to multiply the hub's work and memory; a real
    /// cluster runs a handful.
    pub const INVENTORY_KERNELS: usize = 256;
    /// The bytes of an error text a receiver keeps and logs: an agent event's error on the
    /// proxy, a node status's reason and message on the hub. Longer texts are cut (at a
    /// char boundary): enough for modprobe's or a registry's answer, while a peer sending
    /// megabytes per error cannot make its receiver hold them.
    pub const ERROR_TEXT: usize = 2 << 10;
    /// The most modules an agent's hello may name as loaded (`AgentHello.loaded`): the
    /// proxy keeps a proof, and possibly a failure, for each. A node runs a handful.
    pub const AGENT_LOADED: usize = 256;
    /// The bytes of a module's version or image digest a receiver keeps (an OCI digest
    /// is 71, a version a label value of at most 63).
    pub const MODULE_VERSION: usize = 128;
    /// The most images one `SpokeImageReport` may answer for: the hub asks a cluster to
    /// resolve only the images it cannot check itself, a handful per module; the hub
    /// drops the answers beyond (and those it never asked for).
    pub const SPOKE_IMAGES: usize = 1024;

    /// Whether `release` is a kernel release a peer may name: 1 to [`KERNEL_RELEASE`]
    /// bytes of ASCII letters, digits and `.`, `-`, `_`, `+`, `~` (what `uname -r` shows
    /// of distribution and custom kernels alike, and what image tags can carry).
    pub fn valid_kernel_release(release: &str) -> bool {
        !release.is_empty()
            && release.len() <= KERNEL_RELEASE
            && release
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-+~".contains(&b))
    }

    /// `text` cut to at most `max` bytes, at the last char boundary that fits.
    pub fn truncated(text: &str, max: usize) -> &str {
        if text.len() <= max {
            return text;
        }
        let end = (0..=max)
            .rev()
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(0);
        &text[..end]
    }

    /// Cuts `text` in place to at most `max` bytes (see [`truncated`]), releasing what it
    /// no longer needs: a cut text keeping the capacity of a megabyte one would hold the
    /// megabyte all the same.
    pub fn truncate(text: &mut String, max: usize) {
        let keep = truncated(text, max).len();
        if keep < text.len() {
            text.truncate(keep);
            text.shrink_to_fit();
        }
    }
}

/// A node status report cut into parts of at most `max_bytes` of entries each (at least
/// one entry per part), every part with the report's `full` and `intent_revision`, all
/// but the last marked `continued`. A report that fits is its own single part.
pub fn report_parts(report: v1::NodeStatusReport, max_bytes: usize) -> Vec<v1::NodeStatusReport> {
    use prost::Message;
    let part = |statuses, removed| v1::NodeStatusReport {
        full: report.full,
        statuses,
        removed,
        intent_revision: report.intent_revision,
        continued: true,
    };
    let mut parts = Vec::new();
    let (mut statuses, mut removed, mut size) = (Vec::new(), Vec::new(), 0);
    for status in report.statuses {
        let len = entry_len(status.encoded_len());
        if size + len > max_bytes && !(statuses.is_empty() && removed.is_empty()) {
            parts.push(part(std::mem::take(&mut statuses), Vec::new()));
            size = 0;
        }
        size += len;
        statuses.push(status);
    }
    for key in report.removed {
        let len = entry_len(key.encoded_len());
        if size + len > max_bytes && !(statuses.is_empty() && removed.is_empty()) {
            parts.push(part(
                std::mem::take(&mut statuses),
                std::mem::take(&mut removed),
            ));
            size = 0;
        }
        size += len;
        removed.push(key);
    }
    parts.push(part(statuses, removed));
    if let Some(last) = parts.last_mut() {
        last.continued = false;
    }
    parts
}

/// What a repeated message field's entry adds to its message: tag, length, body.
fn entry_len(body: usize) -> usize {
    1 + prost::length_delimiter_len(body) + body
}

/// The snapshot of `revision` to send when the stream last carried the intents
/// `previous` and must now carry `next`: only the intents that are new or differ and the
/// modules that left (see `IntentSnapshot.delta`), so that a change of one module costs
/// each cluster one intent on the wire, not its whole snapshot. Credentials are always
/// complete.
pub fn snapshot_delta<P, N>(
    previous: &[P],
    next: &[N],
    revision: u64,
    credentials: &[v1::PullCredential],
) -> v1::IntentSnapshot
where
    P: std::borrow::Borrow<v1::ModuleIntent>,
    N: std::borrow::Borrow<v1::ModuleIntent>,
{
    let before: std::collections::HashMap<_, _> = previous
        .iter()
        .map(|m| (module_key(m.borrow()), m.borrow()))
        .collect();
    let after: std::collections::HashSet<_> = next.iter().map(|m| module_key(m.borrow())).collect();
    v1::IntentSnapshot {
        revision,
        modules: next
            .iter()
            .map(std::borrow::Borrow::borrow)
            .filter(|m| before.get(&module_key(m)) != Some(m))
            .cloned()
            .collect(),
        credentials: credentials.to_vec(),
        delta: true,
        removed: previous
            .iter()
            .map(std::borrow::Borrow::borrow)
            .filter(|m| !after.contains(&module_key(m)))
            .filter_map(|m| m.key.clone())
            .collect(),
    }
}

/// The complete snapshot `received` stands for, given the one applied before it
/// (`None` before any): a complete snapshot as it is, a delta applied to `previous`.
/// Modules are kept in the order the hub sends them, by name then namespace.
pub fn apply_snapshot(
    previous: Option<&v1::IntentSnapshot>,
    received: v1::IntentSnapshot,
) -> v1::IntentSnapshot {
    if !received.delta {
        return received;
    }
    let removed: std::collections::HashSet<(String, String)> = received
        .removed
        .iter()
        .map(|k| (k.name.clone(), k.namespace.clone()))
        .collect();
    let mut modules: std::collections::BTreeMap<(String, String), v1::ModuleIntent> = previous
        .into_iter()
        .flat_map(|p| p.modules.iter())
        .map(|m| (module_key(m), m.clone()))
        .filter(|(key, _)| !removed.contains(key))
        .collect();
    modules.extend(received.modules.into_iter().map(|m| (module_key(&m), m)));
    v1::IntentSnapshot {
        revision: received.revision,
        modules: modules.into_values().collect(),
        credentials: received.credentials,
        delta: false,
        removed: Vec::new(),
    }
}

/// The digest a proxy names in its hello (`ProxyHello.applied_intent_digest`) and a hub
/// compares its snapshot with: SHA-256 over the intents in (name, namespace) order and the
/// credentials in id order, each as its encoded length and bytes. Neither the revision nor
/// the way the snapshot came (whole or as deltas) counts, only what it leaves held.
pub fn snapshot_digest<M: std::borrow::Borrow<v1::ModuleIntent>>(
    modules: &[M],
    credentials: &[v1::PullCredential],
) -> [u8; 32] {
    use prost::Message;
    use sha2::Digest;
    let mut modules: Vec<&v1::ModuleIntent> = modules.iter().map(|m| m.borrow()).collect();
    modules.sort_by_cached_key(|m| module_key(m));
    let mut credentials: Vec<&v1::PullCredential> = credentials.iter().collect();
    credentials.sort_by(|a, b| a.id.cmp(&b.id));
    let mut hasher = sha2::Sha256::new();
    let mut add = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(bytes);
    };
    for module in &modules {
        add(&module.encode_to_vec());
    }
    // Between the two lists, so that no intent can pass for a credential.
    add(b"credentials");
    for credential in &credentials {
        add(&credential.encode_to_vec());
    }
    hasher.finalize().into()
}

/// A module intent's identity: (name, namespace).
fn module_key(module: &v1::ModuleIntent) -> (String, String) {
    module
        .key
        .as_ref()
        .map(|k| (k.name.clone(), k.namespace.clone()))
        .unwrap_or_default()
}

/// Generated code for package `kmm.v1`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("kmm.v1");
}
