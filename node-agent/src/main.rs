//! `kmm-node-agent`: the one kmm-fleet pod on every node.

mod check_command;
mod run_command;
mod standalone;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::builder::NonEmptyStringValueParser;
use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};
use kmm_node_agent::check_image::EXIT_CODES;
use kmm_node_agent::image::Limits;
use kmm_node_agent::image::pull::PullLimits;
use kmm_node_agent::proxy_connection;
use kmm_runtime::cli::LoggingArgs;

/// The kmm-fleet agent that runs once on every node (one DaemonSet pod).
///
/// It connects to kmm-spoke-proxy (TLS, authenticated with the pod's projected
/// ServiceAccount token), receives its node's desired kernel modules, pulls the kmod
/// images, extracts only the module and firmware files (refusing hostile images), runs
/// modprobe, and reports every load and unload with its outcome. It keeps its state
/// under /run/kmm so that a restart never reloads what is loaded and a reboot loads
/// again. It has no Kubernetes API access at all. Unloading happens only when asked for
/// explicitly: neither a lost connection nor SIGTERM ever unloads anything.
#[derive(Debug, Parser)]
#[command(name = "kmm-node-agent", version)]
struct Cli {
    #[command(flatten)]
    logging: LoggingArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the agent: reconcile the node's kernel modules with the desired ones.
    ///
    /// The desired modules come from kmm-spoke-proxy (--proxy-address, with
    /// --proxy-ca-file and --token-file) or, standalone, from --desired-file (re-read
    /// when it changes; every event is then written to standard output as one JSON
    /// line, after a first `hello` line). Exactly one of the two is required.
    /// /metrics, /healthz and /readyz are served on --metrics-addr; /readyz answers ok
    /// once the first desired modules were acted on and, with a proxy, while connected.
    Run(RunArgs),
    /// Check a kmod image the way a node would, without loading anything.
    ///
    /// Pulls the image, extracts <dir-name>/lib/modules/<kernel>/, checks each module's
    /// vermagic against the kernel, resolves dependencies with `modprobe --dry-run` and
    /// reports OK or the precise problem.
    #[command(after_help = EXIT_CODES)]
    CheckImage(CheckArgs),
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Backend {
    /// The node's real kernel (/proc, /sys, modprobe).
    Host,
    /// A simulated node's kernel kept in --simulated-dir, with real modprobe dry runs
    /// and modinfo checks.
    Simulated,
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("control").required(true).args(["proxy_address", "desired_file"])))]
struct RunArgs {
    /// Node name (from the downward API); must be the node the token is bound to.
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// kmm-spoke-proxy's agent endpoint, https://HOST:PORT. The stream is reopened
    /// with jittered exponential backoff (up to 30 s) whenever it fails.
    #[arg(
        long,
        value_parser = parse_proxy_address,
        requires_all = ["proxy_ca_file", "token_file"]
    )]
    proxy_address: Option<String>,
    /// The name the proxy's serving certificate must carry, verified by TLS instead of
    /// the host of --proxy-address (default). Needed when the address is the Service's
    /// ClusterIP: kmm-spoke-proxy.<namespace>.svc, which the proxy's certificate names.
    #[arg(long, value_parser = parse_server_name, requires = "proxy_address")]
    proxy_server_name: Option<String>,
    /// PEM CA certificate the proxy's serving certificate must chain to (the
    /// kmm-agent-ca ConfigMap, mounted); re-read at every connection.
    #[arg(long, requires = "proxy_address")]
    proxy_ca_file: Option<PathBuf>,
    /// The projected ServiceAccount token (audience kmm-spoke-proxy), sent as
    /// `authorization: Bearer`; re-read at every connection as the kubelet rotates it.
    #[arg(long, requires = "proxy_address")]
    token_file: Option<PathBuf>,
    /// Address serving /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:8082")]
    metrics_addr: SocketAddr,
    /// State directory; must survive agent restarts and be emptied by reboots.
    #[arg(long, default_value = "/run/kmm")]
    state_dir: PathBuf,
    /// Image cache (content-addressed, garbage-collected).
    #[arg(long, default_value = "/var/cache/kmm")]
    cache_dir: PathBuf,
    /// How long an image no module uses any more stays in the cache, in seconds, so that
    /// loading it again (a module created again, a rollback) pulls nothing. 0 removes it
    /// as soon as it is unused.
    #[arg(long, default_value_t = kmm_node_agent::reconcile::DEFAULT_UNUSED_IMAGE_RETENTION.as_secs())]
    unused_image_retention_seconds: u64,
    /// Host directory firmware is copied to; when it is not /lib/firmware the kernel's
    /// firmware_class search path is set to it. In a Pod it is mounted at the same path,
    /// since the kernel is told the host's.
    #[arg(long, default_value = kmm_node_agent::firmware::DEFAULT_FIRMWARE_DIR, value_parser = absolute_dir)]
    firmware_dir: PathBuf,
    /// Which kernel to act on.
    #[arg(long, value_enum, default_value = "host")]
    kernel_backend: Backend,
    /// Simulated backend: the node's kernel state directory.
    #[arg(long, required_if_eq("kernel_backend", "simulated"))]
    simulated_dir: Option<PathBuf>,
    /// Simulated backend: the node's kernel release (`uname -r`). Default: what
    /// <simulated-dir>/release holds (trimmed), or, when there is no such file, the
    /// release of the machine the agent runs on.
    #[arg(long, value_parser = NonEmptyStringValueParser::new())]
    simulated_kernel: Option<String>,
    /// JSON file with the desired modules (a stand-in for the proxy connection):
    /// {revision?, modules: [{key, version?, image, digest?, modprobe: {moduleName,
    /// parameters, dirName, args: {load, unload}, rawArgs, firmwarePath,
    /// modulesLoadingOrder}, inTreeModulesToRemove, registryTls: {insecure,
    /// insecureSkipTLSVerify}, pullSecret?: {dockerConfigJson | dockerCfg: "<content>"}}],
    /// unload?: ["<namespace>/<name>", ...]}. A module left out is left alone; only
    /// keys listed under "unload" are unloaded.
    #[arg(long)]
    desired_file: Option<PathBuf>,
    /// How often --desired-file is checked for changes, in milliseconds.
    #[arg(long, default_value_t = 500)]
    desired_poll_ms: u64,
    #[command(flatten)]
    limits: LimitArgs,
    /// How many images are pulled at once; more wait for a free pull. Unloads never
    /// wait for pulls.
    #[arg(
        long,
        default_value_t = kmm_node_agent::image::DEFAULT_CONCURRENT_PULLS,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    concurrent_pulls: usize,
    /// First retry delay after a failure, in seconds (doubles up to 120).
    #[arg(long, default_value_t = 2)]
    retry_seconds: u64,
    /// PEM CA certificates registries' TLS certificates may chain to besides the
    /// system's (the add-on's variables REGISTRY_CA_BUNDLE_n): an internal CA needs no
    /// insecureSkipTLSVerify. Read at each pull; an empty file adds none. A file that
    /// cannot be used fails the pulls, naming it.
    #[arg(long)]
    registry_ca_file: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct LimitArgs {
    /// Largest file extracted from an image, in bytes.
    #[arg(long, default_value_t = Limits::default().max_file_bytes)]
    max_file_bytes: u64,
    /// Largest total extracted from one image, in bytes.
    #[arg(long, default_value_t = Limits::default().max_image_bytes)]
    max_image_bytes: u64,
    /// How long one image's pull (tag, manifest and every layer) may take in all, in
    /// seconds, however steadily the registry sends.
    #[arg(long, default_value_t = PullLimits::DEFAULT_DEADLINE.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    pull_timeout_seconds: u64,
    /// Largest manifest read, in bytes; a longer one is refused without being read whole.
    #[arg(long, default_value_t = PullLimits::DEFAULT_MAX_MANIFEST_BYTES)]
    max_manifest_bytes: u64,
    /// Largest size a layer may declare, in bytes; a larger one is refused before any
    /// layer is downloaded.
    #[arg(long, default_value_t = PullLimits::DEFAULT_MAX_LAYER_BYTES)]
    max_layer_bytes: u64,
    /// Most bytes of layers the image cache holds, downloads under way included; a pull
    /// that would go over is refused before downloading.
    #[arg(long, default_value_t = PullLimits::DEFAULT_MAX_CACHE_BYTES)]
    max_cache_bytes: u64,
}

impl LimitArgs {
    fn limits(&self) -> Limits {
        Limits {
            max_file_bytes: self.max_file_bytes,
            max_image_bytes: self.max_image_bytes,
            ..Limits::default()
        }
    }

    fn pull_limits(&self) -> PullLimits {
        PullLimits {
            deadline: std::time::Duration::from_secs(self.pull_timeout_seconds),
            max_manifest_bytes: self.max_manifest_bytes,
            max_layer_bytes: self.max_layer_bytes,
            max_cache_bytes: self.max_cache_bytes,
        }
    }
}

#[derive(Debug, Args)]
struct CheckArgs {
    /// Image reference (tag or digest).
    #[arg(long)]
    image: String,
    /// Kernel release the module must load on (`uname -r` of the target nodes).
    #[arg(long)]
    kernel: String,
    /// Module name as given to modprobe.
    #[arg(long)]
    module: String,
    /// Directory of lib/modules inside the image (upstream's dirName).
    #[arg(long, default_value = kmm_node_agent::desired::DEFAULT_DIR_NAME)]
    dir_name: String,
    /// Firmware directory inside the image, extracted too.
    #[arg(long)]
    firmware_path: Option<String>,
    /// Plain HTTP registry.
    #[arg(long)]
    insecure: bool,
    /// HTTPS without verifying the registry's certificate.
    #[arg(long)]
    insecure_skip_tls_verify: bool,
    /// A docker config.json (`{"auths": ...}`) with credentials for the registry.
    #[arg(long)]
    registry_config: Option<PathBuf>,
    /// PEM CA certificates the registry's TLS certificate may chain to besides the
    /// system's, as the agent's own flag (a registry behind an internal CA).
    #[arg(long)]
    registry_ca_file: Option<PathBuf>,
    /// Fail (exit 9) when a module carries no signature.
    #[arg(long)]
    require_signature: bool,
    /// Image cache; a temporary directory by default.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    #[command(flatten)]
    limits: LimitArgs,
}

fn parse_proxy_address(address: &str) -> Result<String, String> {
    proxy_connection::validate_address(address).map(|()| address.to_string())
}

fn parse_server_name(name: &str) -> Result<String, String> {
    proxy_connection::validate_server_name(name).map(|()| name.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    kmm_runtime::logging::init(&cli.logging);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kmm-node-agent: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = match cli.command {
        Command::Run(args) => match runtime.block_on(run_command::run(args)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = format!("{e:#}"), "agent failed");
                ExitCode::FAILURE
            }
        },
        Command::CheckImage(args) => runtime.block_on(check_command::run(args)),
    };
    // Blocking work still running (a modprobe) is not waited for: state is saved
    // atomically after each step, so exiting now is safe.
    runtime.shutdown_background();
    code
}

/// An absolute directory (the kernel is told it as is): a relative or empty one, as an
/// unset add-on variable renders, is refused at startup.
fn absolute_dir(value: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(value);
    if path.is_absolute() {
        Ok(path)
    } else {
        Err(format!("{value:?} is not an absolute path"))
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "kmm-node-agent",
            "run",
            "--node-name",
            "n",
            "--desired-file",
            "d.json",
            "--kernel-backend",
            "simulated",
        ]);
        assert!(cli.is_err(), "the simulated backend needs its directory");
        let cli = Cli::try_parse_from([
            "kmm-node-agent",
            "run",
            "--node-name",
            "n",
            "--desired-file",
            "d.json",
            "--kernel-backend",
            "simulated",
            "--simulated-dir",
            "kernel",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            unreachable!()
        };
        assert_eq!(args.simulated_kernel, None, "read from the directory");
        let e = run_error(&["--desired-file", "d", "--simulated-kernel="]);
        assert!(e.contains("--simulated-kernel"), "{e}");
        assert!(
            Cli::try_parse_from([
                "kmm-node-agent",
                "run",
                "--node-name",
                "n",
                "--desired-file",
                "d"
            ])
            .is_ok()
        );
    }

    /// The flags of `run` with the proxy, all valid.
    const WITH_PROXY: [&str; 6] = [
        "--proxy-address",
        "https://127.0.0.1:7444",
        "--proxy-ca-file",
        "ca",
        "--token-file",
        "t",
    ];

    fn run_error(args: &[&str]) -> String {
        let mut argv = vec!["kmm-node-agent", "run", "--node-name", "n"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap_err().to_string()
    }

    #[test]
    fn exactly_one_control_plane() {
        let e = run_error(&[]);
        assert!(
            e.contains("--proxy-address") && e.contains("--desired-file"),
            "{e}"
        );
        let e = run_error(&[&["--desired-file", "d"][..], &WITH_PROXY].concat());
        assert!(e.contains("cannot be used with"), "{e}");
        let e = run_error(&["--proxy-address", "https://127.0.0.1:7444"]);
        assert!(
            e.contains("--proxy-ca-file") && e.contains("--token-file"),
            "{e}"
        );
        let e = run_error(&["--desired-file", "d", "--token-file", "t"]);
        assert!(e.contains("--proxy-address"), "{e}");
        let e = run_error(&["--desired-file", "d", "--proxy-server-name", "p.kmm.svc"]);
        assert!(e.contains("--proxy-address"), "{e}");
        let e = run_error(&[
            "--proxy-address",
            "https://10.96.0.12:7444",
            "--proxy-server-name=",
            "--proxy-ca-file",
            "ca",
            "--token-file",
            "t",
        ]);
        assert!(e.contains("--proxy-server-name"), "{e}");
        let e = run_error(&[
            "--proxy-address",
            "http://127.0.0.1:7444",
            "--proxy-ca-file",
            "ca",
            "--token-file",
            "t",
        ]);
        assert!(e.contains("must start with https://"), "{e}");
        let cli = Cli::try_parse_from([
            "kmm-node-agent",
            "run",
            "--node-name",
            "n",
            "--proxy-address",
            "https://127.0.0.1:7444",
            "--proxy-ca-file",
            "ca",
            "--token-file",
            "t",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            unreachable!()
        };
        assert_eq!(args.metrics_addr.to_string(), "0.0.0.0:8082");
        assert_eq!(args.proxy_server_name, None);
    }

    #[test]
    fn a_firmware_dir_that_is_not_absolute_is_refused_naming_it() {
        for value in ["", "lib/firmware"] {
            let firmware_dir = format!("--firmware-dir={value}");
            let error = run_error(&[&WITH_PROXY[..], &[firmware_dir.as_str()]].concat());
            assert!(error.contains("--firmware-dir"), "{error}");
            assert!(error.contains("is not an absolute path"), "{error}");
        }
    }
}
