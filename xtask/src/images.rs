//! `cargo xtask images`: container images of kmm-hub, kmm-spoke-proxy, kmm-node-agent and
//! the builder kmm-hub's build Jobs run (the building itself is the `kmm-images` crate,
//! which the local fleet calls too).

use anyhow::Context;
use kmm_images::{self as images, Image};

#[derive(Debug, clap::Args)]
pub struct Options {
    /// Push the bases and images to this registry (`host:port`; plain HTTP when it is on
    /// loopback, like the local fleet's `cargo xtask env registry`).
    #[arg(long, value_name = "REGISTRY")]
    push: Option<String>,
    /// The images' tag.
    #[arg(long, default_value = images::VERSION)]
    tag: String,
}

pub fn run(options: &Options) -> anyhow::Result<()> {
    eprintln!(
        "==> cargo build --release -p kmm-hub -p kmm-spoke-proxy -p kmm-node-agent, \
         then the bases and images with buildah"
    );
    let built = images::build(&images::Options {
        tag: options.tag.clone(),
        ..images::Options::new(options.push.clone())
    })
    .context("building the container images")?;
    for base in &built.bases {
        println!("base: {}", describe(base));
    }
    for image in &built.images {
        println!("image: {}", describe(image));
    }
    Ok(())
}

/// `kmm-hub 127.0.0.1:16005/kmm-fleet/kmm-hub:0.1.0 size_mib=18.3 compressed_mib=7.2 built`
fn describe(image: &Image) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    format!(
        "{} {} size_mib={:.1} compressed_mib={:.1} {}",
        image.name,
        image.pushed.as_deref().unwrap_or(&image.reference),
        image.size as f64 / MIB,
        image.compressed_size as f64 / MIB,
        if image.rebuilt { "built" } else { "unchanged" }
    )
}
