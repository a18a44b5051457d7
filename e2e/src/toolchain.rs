//! Builds the pinned upstream programs from the Go module proxy, cached by version.
//!
//! Each component is a tiny wrapper Go module (templates in `e2e/toolchain/<name>/`)
//! that requires the upstream module at the pinned version; `go build` of the upstream
//! `main` packages then resolves everything through the module proxy. Results land in
//! `<cache>/bin/<name>-<version>/`. `KMM_FLEET_BIN_DIR` points at a directory of prebuilt
//! binaries instead, and disables building.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::versions::Versions;
use crate::{Error, IoContext, Result, cache_dir, cache_entry};

const TEMPLATES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/toolchain");

/// Environment variable naming a directory of prebuilt binaries.
pub const BIN_DIR_ENV: &str = "KMM_FLEET_BIN_DIR";

/// One upstream module and the programs built from it.
#[derive(Debug, Clone)]
pub struct Component {
    pub name: &'static str,
    pub version: String,
    /// Go packages to build; the binary is named after the last path element.
    packages: Vec<&'static str>,
    /// Placeholder substitutions for `go.mod.in` besides `@VERSION@`.
    substitutions: Vec<(&'static str, String)>,
    /// `-X` linker settings: upstream stamps its version this way in its release builds.
    version_vars: Vec<String>,
}

impl Component {
    pub fn binaries(&self) -> Vec<&'static str> {
        self.packages
            .iter()
            .map(|p| {
                if *p == "." {
                    self.name
                } else {
                    p.rsplit('/').next().unwrap_or(p)
                }
            })
            .collect()
    }

    fn out_dir(&self) -> PathBuf {
        cache_dir()
            .join("bin")
            .join(format!("{}-{}", self.name, self.version))
    }

    fn src_dir(&self) -> PathBuf {
        cache_dir()
            .join("src")
            .join(format!("{}-{}", self.name, self.version))
    }

    fn is_built(&self) -> bool {
        let out = self.out_dir();
        self.binaries().iter().all(|b| out.join(b).is_file())
    }
}

/// Every component of the local fleet, in build order.
pub fn components(v: &Versions) -> Vec<Component> {
    vec![
        Component {
            name: "etcd",
            version: v.etcd.version.clone(),
            packages: vec!["."],
            substitutions: vec![],
            version_vars: vec![],
        },
        Component {
            name: "kubernetes",
            version: v.kubernetes.version.clone(),
            packages: vec![
                "k8s.io/kubernetes/cmd/kube-apiserver",
                "k8s.io/kubernetes/cmd/kube-controller-manager",
                "k8s.io/kubernetes/cmd/kube-scheduler",
                // The real nodes'.
                "k8s.io/kubernetes/cmd/kubelet",
                "k8s.io/kubernetes/cmd/kube-proxy",
                // `kubectl apply -k`: the fleet installs kmm-hub as a user does.
                "k8s.io/kubernetes/cmd/kubectl",
            ],
            substitutions: vec![],
            version_vars: kubernetes_version_vars(&v.kubernetes.version),
        },
        Component {
            name: "ocm",
            version: v.ocm.version.clone(),
            packages: vec![
                "open-cluster-management.io/ocm/cmd/registration",
                "open-cluster-management.io/ocm/cmd/addon",
                "open-cluster-management.io/ocm/cmd/placement",
                "open-cluster-management.io/ocm/cmd/registration-operator",
            ],
            substitutions: vec![],
            version_vars: vec![],
        },
        Component {
            name: "clusteradm",
            version: v.clusteradm.version.clone(),
            packages: vec!["open-cluster-management.io/clusteradm/cmd/clusteradm"],
            substitutions: vec![("@OCM_VERSION@", v.ocm.version.clone())],
            version_vars: vec![],
        },
        Component {
            name: "kwok",
            version: v.kwok.version.clone(),
            packages: vec!["sigs.k8s.io/kwok/cmd/kwok"],
            substitutions: vec![],
            version_vars: vec![format!(
                "sigs.k8s.io/kwok/pkg/consts.Version={}",
                v.kwok.version.trim_start_matches('v')
            )],
        },
    ]
}

/// Prometheus' server and promtool, which the monitoring tests check the alerting rules
/// and the dashboard with. Nothing in the fleet runs them, so they are not among
/// [`components`] (`cargo xtask env build` does not spend minutes on them): see
/// [`Toolchain::ensure_monitoring`].
pub fn monitoring(v: &Versions) -> Component {
    Component {
        name: "prometheus",
        version: v.prometheus.version.clone(),
        packages: vec![
            "github.com/prometheus/prometheus/cmd/prometheus",
            "github.com/prometheus/prometheus/cmd/promtool",
        ],
        substitutions: vec![],
        version_vars: vec![format!(
            "github.com/prometheus/common/version.Version={}",
            prometheus_release(&v.prometheus.version)
        )],
    }
}

/// Helm, which the chart test renders `charts/kmm-fleet` with and the Helm fleet test
/// installs it with. Like [`monitoring`], not among [`components`]: the fleet itself
/// installs kmm with `kubectl apply -k`. See [`Toolchain::ensure_helm`].
pub fn helm(v: &Versions) -> Component {
    Component {
        name: "helm",
        version: v.helm.version.clone(),
        packages: vec!["helm.sh/helm/v3/cmd/helm"],
        substitutions: vec![],
        // What upstream's release build stamps for `helm version`. Its Makefile also
        // stamps the Kubernetes version `helm template` assumes (the client-go minor);
        // the chart asks for no Kubernetes version, so the built-in default does.
        version_vars: vec![format!(
            "helm.sh/helm/v3/internal/version.version={}",
            v.helm.version
        )],
    }
}

/// The release a Go module version of Prometheus 3 stands for: `v0.316.0` is 3.16.0.
fn prometheus_release(module_version: &str) -> String {
    let mut parts = module_version.trim_start_matches("v0.").splitn(2, '.');
    let combined: u32 = parts.next().unwrap_or_default().parse().unwrap_or_default();
    let patch = parts.next().unwrap_or("0");
    format!("{}.{}.{patch}", combined / 100, combined % 100)
}

/// Where each upstream binary is, by name (`kube-apiserver`, `etcd`, `registration`, ...).
#[derive(Debug, Clone)]
pub struct Toolchain {
    bins: BTreeMap<&'static str, PathBuf>,
}

impl Toolchain {
    /// Locate every binary without building, in `prebuilt` if given, else in the
    /// cache; fails naming the first one missing.
    pub fn locate(v: &Versions, prebuilt: Option<&Path>) -> Result<Self> {
        Self::locate_components(components(v), prebuilt)
    }

    fn locate_components(components: Vec<Component>, prebuilt: Option<&Path>) -> Result<Self> {
        let mut bins = BTreeMap::new();
        for c in components {
            let dir = prebuilt.map_or_else(|| c.out_dir(), Path::to_path_buf);
            for b in c.binaries() {
                let path = dir.join(b);
                if !path.is_file() {
                    let hint = if prebuilt.is_some() {
                        format!("${BIN_DIR_ENV} does not contain it")
                    } else {
                        "run `cargo xtask env build`".to_string()
                    };
                    return Err(Error::Invalid(format!(
                        "{} {} is missing at {}: {hint}",
                        c.name,
                        c.version,
                        path.display()
                    )));
                }
                bins.insert(b, path);
            }
        }
        Ok(Self { bins })
    }

    /// Build every component that is not cached yet (unless `prebuilt` binaries are
    /// given), then locate them. Prints one line per component with the time it took.
    pub fn ensure(v: &Versions, prebuilt: Option<&Path>) -> Result<Self> {
        Self::ensure_components(components(v), prebuilt)
    }

    /// [`Toolchain::ensure`] for the [`monitoring`] programs alone (`prometheus`,
    /// `promtool`): the first call builds them (minutes), later ones find them cached.
    pub fn ensure_monitoring(v: &Versions, prebuilt: Option<&Path>) -> Result<Self> {
        Self::ensure_components(vec![monitoring(v)], prebuilt)
    }

    /// `helm` (the [`helm`] component, built on first use) and the fleet's `kubectl`
    /// (the `kubernetes` component: the chart test renders the kustomize bases with it).
    pub fn ensure_helm(v: &Versions, prebuilt: Option<&Path>) -> Result<Self> {
        let kubernetes = components(v)
            .into_iter()
            .filter(|c| c.name == "kubernetes")
            .collect::<Vec<_>>();
        Self::ensure_components([vec![helm(v)], kubernetes].concat(), prebuilt)
    }

    fn ensure_components(components: Vec<Component>, prebuilt: Option<&Path>) -> Result<Self> {
        if prebuilt.is_none() {
            let total = Instant::now();
            for c in &components {
                let started = Instant::now();
                let built = cache_entry::once(&c.out_dir(), || c.is_built(), || build(c))?;
                if built {
                    eprintln!(
                        "toolchain: built {} {} in {}",
                        c.name,
                        c.version,
                        human(started.elapsed())
                    );
                } else {
                    eprintln!(
                        "toolchain: {} {} cached at {}",
                        c.name,
                        c.version,
                        c.out_dir().display()
                    );
                }
            }
            eprintln!("toolchain: ready in {}", human(total.elapsed()));
        }
        Self::locate_components(components, prebuilt)
    }

    /// Path of one binary; panics on a name that is not part of the toolchain, which is
    /// a programming error.
    pub fn bin(&self, name: &str) -> &Path {
        self.bins
            .get(name)
            .unwrap_or_else(|| panic!("{name} is not a toolchain binary"))
    }
}

/// What Kubernetes' release build stamps, so that the components report their real
/// version (`/version`, skew checks) instead of `v0.0.0-master`.
fn kubernetes_version_vars(version: &str) -> Vec<String> {
    let mut parts = version.trim_start_matches('v').split('.');
    let (major, minor) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ]
    .iter()
    .flat_map(|pkg| {
        [
            format!("{pkg}.gitVersion={version}"),
            format!("{pkg}.gitMajor={major}"),
            format!("{pkg}.gitMinor={minor}"),
            format!("{pkg}.gitTreeState=clean"),
        ]
    })
    .collect()
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    format!("{}m{:02}s", s / 60, s % 60)
}

fn build(c: &Component) -> Result<()> {
    let src = c.src_dir();
    std::fs::create_dir_all(&src).context(|| format!("creating {}", src.display()))?;
    let template_dir = Path::new(TEMPLATES).join(c.name);
    for entry in std::fs::read_dir(&template_dir)
        .context(|| format!("reading {}", template_dir.display()))?
    {
        let entry = entry.context(|| format!("reading {}", template_dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(entry.path())
            .context(|| format!("reading {}", entry.path().display()))?;
        let (target, text) = match name.strip_suffix(".in") {
            Some(target) => (target.to_string(), render(c, &text)?),
            None => (name, text),
        };
        std::fs::write(src.join(&target), text)
            .context(|| format!("writing {target} in {}", src.display()))?;
    }
    let partial = cache_entry::beside(&c.out_dir(), "partial");
    let mut cmd = go(&src);
    let mut ldflags = String::from("-s -w");
    for var in &c.version_vars {
        ldflags.push_str(" -X ");
        ldflags.push_str(var);
    }
    cmd.args(["build", "-mod=mod", "-trimpath"])
        .arg(format!("-ldflags={ldflags}"))
        .arg("-o")
        .arg(format!("{}/", partial.display()))
        .args(&c.packages);
    run(&mut cmd)?;
    let out = c.out_dir();
    // A directory missing some binary (e.g. one added to the component) is rebuilt whole.
    if out.exists() {
        std::fs::remove_dir_all(&out).context(|| format!("removing {}", out.display()))?;
    }
    std::fs::rename(&partial, &out).context(|| format!("moving {} into place", partial.display()))
}

fn render(c: &Component, template: &str) -> Result<String> {
    let mut text = template.replace("@VERSION@", &c.version);
    for (key, value) in &c.substitutions {
        text = text.replace(key, value);
    }
    if text.contains("@STAGING_REPLACES@") {
        text = text.replace("@STAGING_REPLACES@", &staging_replaces(c)?);
    }
    Ok(text)
}

/// The `replace` block mapping each staging module k8s.io/kubernetes replaces with a
/// local directory onto its published version (`v1.X.Y` -> `v0.X.Y`).
fn staging_replaces(c: &Component) -> Result<String> {
    let published = c.version.replacen("v1.", "v0.", 1);
    let mut cmd = go(&cache_dir());
    cmd.args(["mod", "download", "-json"])
        .arg(format!("k8s.io/kubernetes@{}", c.version));
    let out = output(&mut cmd)?;
    let info: serde_json::Value = serde_json::from_slice(&out)
        .map_err(|e| Error::Invalid(format!("go mod download output: {e}")))?;
    let gomod = info["GoMod"]
        .as_str()
        .ok_or_else(|| Error::Invalid(format!("go mod download gave no GoMod: {info}")))?;
    let text = std::fs::read_to_string(gomod).context(|| format!("reading {gomod}"))?;
    Ok(staging_replace_block(&text, &published))
}

fn staging_replace_block(upstream_go_mod: &str, published: &str) -> String {
    let mut block = String::from("replace (\n");
    for line in upstream_go_mod.lines() {
        if let Some((module, target)) = line.trim().split_once(" => ")
            && target.starts_with("./staging/")
        {
            block.push_str(&format!("\t{module} => {module} {published}\n"));
        }
    }
    block.push(')');
    block
}

/// The directory of a module in the Go module cache, downloading it if needed.
pub(crate) fn go_module_dir(module_at_version: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(cache_dir())
        .context(|| format!("creating {}", cache_dir().display()))?;
    let out = output(go(&cache_dir()).args(["mod", "download", "-json", module_at_version]))?;
    let info: serde_json::Value = serde_json::from_slice(&out)
        .map_err(|e| Error::Invalid(format!("go mod download {module_at_version}: {e}")))?;
    info["Dir"]
        .as_str()
        .map(PathBuf::from)
        .ok_or_else(|| Error::Invalid(format!("go mod download {module_at_version}: {info}")))
}

fn go(dir: &Path) -> Command {
    // Upstream builds saturate every core; stay polite to whatever else runs.
    let mut cmd = Command::new("nice");
    cmd.args(["-n", "10", "go"]).current_dir(dir);
    // sum.golang.org is not reachable from CI; the module proxy is the only source.
    if std::env::var_os("GOSUMDB").is_none() {
        cmd.env("GOSUMDB", "off");
    }
    cmd.env("GOFLAGS", "-buildvcs=false");
    cmd
}

fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .context(|| format!("running {}", describe(cmd)))?;
    if !status.success() {
        return Err(Error::Command {
            command: describe(cmd),
            status: status.to_string(),
        });
    }
    Ok(())
}

fn output(cmd: &mut Command) -> Result<Vec<u8>> {
    let out = cmd
        .output()
        .context(|| format!("running {}", describe(cmd)))?;
    if !out.status.success() {
        return Err(Error::Command {
            command: describe(cmd),
            status: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(out.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_replacements_use_published_versions() {
        let upstream = "module k8s.io/kubernetes\nreplace (\n\tk8s.io/api => ./staging/src/k8s.io/api\n\tgithub.com/x/y => github.com/x/y v1.0.0\n)\n";
        assert_eq!(
            staging_replace_block(upstream, "v0.35.4"),
            "replace (\n\tk8s.io/api => k8s.io/api v0.35.4\n)"
        );
    }

    #[test]
    fn binaries_are_named_after_packages() {
        let v = Versions::pinned();
        let names: Vec<_> = components(&v)
            .iter()
            .flat_map(Component::binaries)
            .collect();
        assert!(names.contains(&"kube-apiserver"));
        assert!(names.contains(&"kubelet"));
        assert!(names.contains(&"kube-proxy"));
        assert!(names.contains(&"etcd"));
        assert!(names.contains(&"registration-operator"));
        assert_eq!(monitoring(&v).binaries(), ["prometheus", "promtool"]);
        assert_eq!(helm(&v).binaries(), ["helm"]);
    }

    #[test]
    fn prometheus_module_versions_name_their_release() {
        assert_eq!(prometheus_release("v0.316.0"), "3.16.0");
        assert_eq!(prometheus_release("v0.305.2"), "3.5.2");
    }
}
