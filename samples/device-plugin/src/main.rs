//! `kmm-sample-device-plugin`: advertises `--devices` devices of the extended resource
//! `--resource` to the kubelet (device plugin API v1beta1) for as long as it runs. The
//! local fleet runs it as a module's `devicePlugin`: the node's allocatable shows the
//! resource only while the module is loaded.
//!
//! With `--journal FILE` it appends `<ns since the epoch> registered|stopping` lines, the
//! record tests read to order the plugin's life against the module's loads and unloads.

mod plugin;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use clap::Parser;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Endpoint, Server, Uri};

use plugin::v1beta1::registration_client::RegistrationClient;
use plugin::v1beta1::{DevicePluginOptions, RegisterRequest};
use plugin::{API_VERSION, Plugin};

#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The extended resource the devices count as.
    #[arg(long, default_value = "example.com/kmm-hello")]
    resource: String,
    /// How many devices to advertise.
    #[arg(long, default_value_t = 2)]
    devices: u32,
    /// The kubelet's device plugin directory (its `kubelet.sock` is there).
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    dir: PathBuf,
    /// A file to append this plugin's registration and stop to.
    #[arg(long)]
    journal: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt().with_target(false).init();
    let args = Args::parse();
    let endpoint = format!(
        "{}-{}.sock",
        args.resource.replace(['/', '.'], "-"),
        std::process::id()
    );
    let socket = args.dir.join(&endpoint);
    // A socket left by an earlier run of the same PID (a restarted container) is stale.
    let _ = tokio::fs::remove_file(&socket).await;
    let listener = UnixListener::bind(&socket)
        .with_context(|| format!("listening on {}", socket.display()))?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let service = Plugin::new(&args.resource, args.devices, stopped.clone()).service();
    let mut serving = stopped.clone();
    let server = tokio::spawn(
        Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
                let _ = serving.wait_for(|stop| *stop).await;
            }),
    );

    register(&args.dir.join("kubelet.sock"), &endpoint, &args.resource).await?;
    journal(args.journal.as_deref(), "registered").await?;
    tracing::info!(
        resource = args.resource,
        devices = args.devices,
        endpoint,
        "registered with the kubelet"
    );

    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut check = tokio::time::interval(Duration::from_secs(2));
    let outcome = loop {
        tokio::select! {
            _ = terminate.recv() => break Ok(()),
            _ = tokio::signal::ctrl_c() => break Ok(()),
            _ = check.tick() => {
                // A restarted kubelet removes every plugin socket: registering again
                // needs a fresh socket, which a restart of the container gives.
                if !tokio::fs::try_exists(&socket).await.unwrap_or(false) {
                    break Err(anyhow::anyhow!(
                        "{} is gone (the kubelet restarted); exiting to register again",
                        socket.display()
                    ));
                }
            }
        }
    };
    journal(args.journal.as_deref(), "stopping").await?;
    tracing::info!("stopping");
    let _ = stop.send(true);
    let _ = server.await;
    let _ = tokio::fs::remove_file(&socket).await;
    outcome
}

/// Registers the plugin's socket and resource with the kubelet.
async fn register(kubelet: &Path, endpoint: &str, resource: &str) -> Result<()> {
    let path = kubelet.to_path_buf();
    // The URI is required by the API but unused: the connector dials the socket.
    let channel = Endpoint::try_from("http://kubelet.invalid")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .with_context(|| format!("connecting to the kubelet at {}", kubelet.display()))?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: API_VERSION.to_owned(),
            endpoint: endpoint.to_owned(),
            resource_name: resource.to_owned(),
            options: Some(DevicePluginOptions::default()),
        })
        .await
        .context("the kubelet refused the registration")?;
    Ok(())
}

async fn journal(path: Option<&Path>, what: &str) -> Result<()> {
    let Some(path) = path else { return Ok(()) };
    let at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .await
        .with_context(|| format!("opening {}", path.display()))?;
    file.write_all(format!("{at} {what}\n").as_bytes()).await?;
    file.sync_all().await?;
    Ok(())
}
