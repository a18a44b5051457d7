//! `kmm-node-agent check-image`: a kmod image checked the way a node would load it,
//! without loading anything; the answer on stdout and as the exit code.

use std::process::ExitCode;

use kmm_node_agent::check_image::{self, CheckOptions};
use kmm_node_agent::desired::{PullSecret, RegistryTls};

use crate::CheckArgs;

pub(crate) async fn run(args: CheckArgs) -> ExitCode {
    let secret = match &args.registry_config {
        Some(path) => match std::fs::read_to_string(path) {
            Ok(text) => Some(PullSecret::DockerConfigJson(text)),
            Err(e) => {
                eprintln!("cannot read {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        },
        None => None,
    };
    // Removed when the check ends, however it ends.
    let temp;
    let cache_dir = match &args.cache_dir {
        Some(dir) => dir.clone(),
        None => match tempfile::Builder::new()
            .prefix("kmm-check-image-")
            .tempdir()
        {
            Ok(dir) => {
                temp = dir;
                temp.path().to_path_buf()
            }
            Err(e) => {
                eprintln!("cannot create a temporary directory: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let options = CheckOptions {
        image: args.image.clone(),
        kernel: args.kernel.clone(),
        module: args.module.clone(),
        dir_name: args.dir_name.clone(),
        firmware_path: args.firmware_path.clone(),
        tls: RegistryTls {
            insecure: args.insecure,
            insecure_skip_tls_verify: args.insecure_skip_tls_verify,
        },
        secret,
        registry_ca_file: args.registry_ca_file.clone(),
        require_signature: args.require_signature,
        cache_dir,
        limits: args.limits.limits(),
        pull_limits: args.limits.pull_limits(),
    };
    match check_image::check_image(&options).await {
        Ok(report) => {
            println!(
                "OK: {} ({}) loads on kernel {}",
                args.image, report.digest, args.kernel
            );
            for module in &report.modules {
                let signer = module.signer.as_deref().unwrap_or("unsigned");
                println!("  {} ({signer})", module.name);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("FAIL: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
