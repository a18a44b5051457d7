//! `kmm-node-agent check-image`: for module vendors, the checks a node would make,
//! without loading anything: pull, extract, vermagic against the kernel, dependency
//! resolution with modprobe's dry run, and optionally signatures.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::desired::{PullSecret, RegistryTls};
use crate::image::cache::{Cache, CacheError};
use crate::image::pull::{PullError, PullLimit, PullLimits, PullRequest};
use crate::image::{FetchRequest, ImageError, ImageStore, Limits};
use crate::modprobe::{self, ToolError, module_name_of};
use crate::reconcile::module_dir;

/// What to check.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    pub image: String,
    pub kernel: String,
    pub module: String,
    pub dir_name: String,
    pub firmware_path: Option<String>,
    pub tls: RegistryTls,
    pub secret: Option<PullSecret>,
    /// Extra CAs for the registry's TLS (the agent's `--registry-ca-file`).
    pub registry_ca_file: Option<PathBuf>,
    pub require_signature: bool,
    pub cache_dir: PathBuf,
    pub limits: Limits,
    pub pull_limits: PullLimits,
}

/// One module modprobe would insert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedModule {
    pub name: String,
    pub path: PathBuf,
    pub signer: Option<String>,
}

/// A passed check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReport {
    pub digest: String,
    /// Dependencies first, the module last.
    pub modules: Vec<CheckedModule>,
}

/// Why the image would not load, each with its own exit code.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("cannot pull the image: {0}")]
    Pull(String),
    #[error("the registry refused the credentials: {0}")]
    Unauthorized(String),
    #[error("the image is refused: {0}")]
    Refused(String),
    #[error("wrong kernel: {0}")]
    WrongKernel(String),
    #[error("module not found: {0}")]
    ModuleNotFound(String),
    #[error("missing dependency: {0}")]
    MissingDependency(String),
    #[error("unsigned module: {0}")]
    Unsigned(String),
    #[error("{0}")]
    Local(String),
}

impl CheckError {
    /// 3 pull, 4 credentials, 5 refused image, 6 wrong kernel, 7 module not found,
    /// 8 missing dependency, 9 unsigned, 1 anything else (2 is a usage error).
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Pull(_) => 3,
            Self::Unauthorized(_) => 4,
            Self::Refused(_) => 5,
            Self::WrongKernel(_) => 6,
            Self::ModuleNotFound(_) => 7,
            Self::MissingDependency(_) => 8,
            Self::Unsigned(_) => 9,
            Self::Local(_) => 1,
        }
    }
}

/// The exit codes, for `--help`.
pub const EXIT_CODES: &str = "Exit codes: 0 the module would load; 1 local failure; 2 usage error; \
3 the image cannot be pulled; 4 the registry refused the credentials; 5 the image is refused \
(hostile, corrupt, or over a size limit); 6 wrong kernel (no modules for it, or built for another); \
7 the module is not in the image; 8 a dependency is missing; 9 unsigned while --require-signature.";

fn local(e: impl std::error::Error) -> CheckError {
    CheckError::Local(crate::image::pull::error_chain(&e))
}

impl From<ImageError> for CheckError {
    fn from(e: ImageError) -> Self {
        let text = crate::image::pull::error_chain(&e);
        match e {
            ImageError::Pull(PullError::Registry(ref e)) if e.is_unauthorized() => {
                Self::Unauthorized(text)
            }
            ImageError::Pull(PullError::UnsupportedLayer { .. }) => Self::Refused(text),
            ImageError::Pull(ref e) if e.limit().is_some_and(|l| l != PullLimit::Deadline) => {
                Self::Refused(text)
            }
            ImageError::Pull(PullError::Cache(_)) | ImageError::Cache(_) => Self::Local(text),
            ImageError::Pull(_) => Self::Pull(text),
            ImageError::Refused { ref source, .. } if source.is_image_fault() => {
                Self::Refused(text)
            }
            ImageError::Refused { .. } => Self::Local(text),
        }
    }
}

/// Names of the module files the image holds for the kernel.
fn modules_in_image(module_dir: &Path, kernel: &str) -> BTreeSet<String> {
    fn walk(dir: &Path, out: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                walk(&path, out);
            } else if path.to_string_lossy().contains(".ko") {
                out.insert(module_name_of(&path));
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(&module_dir.join("lib/modules").join(kernel), &mut out);
    out
}

pub async fn check_image(options: &CheckOptions) -> Result<CheckReport, CheckError> {
    let cache = Cache::open(&options.cache_dir).map_err(|e: CacheError| local(e))?;
    let store = ImageStore::new(cache, options.limits)
        .with_pull_limits(options.pull_limits)
        .with_registry_ca_file(options.registry_ca_file.clone());
    let request = FetchRequest {
        pull: PullRequest {
            image: &options.image,
            tls: options.tls,
            secret: options.secret.as_ref(),
        },
        digest: None,
        selection: kmm_extract::Selection {
            dir_name: options.dir_name.clone(),
            kernel: options.kernel.clone(),
            firmware_path: options.firmware_path.clone(),
            host_modules: Some(modprobe::HOST_MODULES.into()),
        },
    };
    let fetched = store.fetch(&request).await?;
    let module_dir = module_dir(&fetched.root, &options.dir_name);
    let kernel_dir = module_dir.join("lib/modules").join(&options.kernel);
    if !kernel_dir.is_dir() {
        return Err(CheckError::WrongKernel(format!(
            "{} has no {}/lib/modules/{}",
            options.image,
            options.dir_name.trim_end_matches('/'),
            options.kernel
        )));
    }
    modprobe::depmod_if_needed(&module_dir, &options.kernel).map_err(local)?;
    let chain =
        match modprobe::resolve_with_dry_run(&module_dir, &options.kernel, &options.module, &[]) {
            Ok(chain) if chain.is_empty() => {
                return Err(CheckError::ModuleNotFound(format!(
                    "{} is not a loadable module in {}",
                    options.module, options.image
                )));
            }
            Ok(chain) => chain,
            Err(ToolError::Failed { stderr, .. }) if stderr.contains("not found") => {
                return Err(CheckError::ModuleNotFound(format!(
                    "{} is not in {} for kernel {}: {stderr}",
                    options.module, options.image, options.kernel
                )));
            }
            Err(e) => return Err(local(e)),
        };
    let in_image = modules_in_image(&module_dir, &options.kernel);
    if let Some(missing) = chain.iter().find(|insmod| !insmod.path.is_file()) {
        return Err(CheckError::MissingDependency(format!(
            "modules.dep lists {} but the image does not contain it",
            missing
                .path
                .strip_prefix(&fetched.root)
                .unwrap_or(&missing.path)
                .display()
        )));
    }
    let paths: Vec<&Path> = chain.iter().map(|insmod| insmod.path.as_path()).collect();
    let infos = modprobe::modinfo(&paths).map_err(local)?;
    let mut modules = vec![];
    for (insmod, info) in chain.iter().zip(infos) {
        if info.built_for != options.kernel {
            return Err(CheckError::WrongKernel(format!(
                "{} was built for kernel {}, not {}",
                insmod.name, info.built_for, options.kernel
            )));
        }
        for dependency in &info.depends {
            let dependency = dependency.replace('-', "_");
            if !in_image.contains(&dependency) {
                return Err(CheckError::MissingDependency(format!(
                    "{} depends on {dependency}, which is not in the image",
                    insmod.name
                )));
            }
        }
        if options.require_signature && info.signer.is_none() {
            return Err(CheckError::Unsigned(format!(
                "{} carries no signature",
                insmod.name
            )));
        }
        modules.push(CheckedModule {
            name: insmod.name.clone(),
            path: insmod.path.clone(),
            signer: info.signer,
        });
    }
    Ok(CheckReport {
        digest: fetched.digest,
        modules,
    })
}
