//! A simulated node's kernel: loaded modules are files in a per-node directory, but
//! every load goes through the real `modprobe --dry-run` resolution of the extracted
//! image and the real `modinfo` vermagic and dependency checks.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{HostKernel, Kernel, KernelError, io_err};
use crate::modprobe::{ModprobeCommand, modinfo, parse_command, resolve_with_dry_run};
use crate::plan::normalize_module_name;
use crate::shared_modules::Users;

/// One simulated loaded module.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SimulatedModule {
    pub name: String,
    #[serde(default)]
    pub path: Option<PathBuf>,
    #[serde(default)]
    pub depends: Vec<String>,
    #[serde(default)]
    pub parameters: Vec<String>,
    /// Part of the node's own kernel (for `inTreeModulesToRemove`).
    #[serde(default)]
    pub in_tree: bool,
}

/// File in a simulated kernel's directory where every module insert and removal is
/// logged, one line each: `<nanoseconds since the Unix epoch> insert|remove <module>`.
pub const KERNEL_LOG: &str = "kmsg";

#[derive(Clone, Copy, Debug)]
enum KernelLogEvent {
    Insert,
    Remove,
}

impl KernelLogEvent {
    fn word(self) -> &'static str {
        match self {
            Self::Insert => "insert",
            Self::Remove => "remove",
        }
    }
}

/// The kernel of a simulated node, kept in `dir`.
#[derive(Debug, Clone)]
pub struct SimulatedKernel {
    dir: PathBuf,
    release: String,
}

impl SimulatedKernel {
    /// The kernel release (`uname -r`) of the simulated node in `dir`: what
    /// `<dir>/release` holds, trimmed, or when there is no such file, the machine's own,
    /// so that modules built for the machine's kernel load on a node nobody configured.
    pub fn node_release(dir: &Path) -> Result<String, KernelError> {
        let path = dir.join("release");
        match std::fs::read_to_string(&path) {
            Ok(text) if text.trim().is_empty() => Err(KernelError::Refused(format!(
                "{} is empty: it must hold the simulated node's kernel release",
                path.display()
            ))),
            Ok(text) => Ok(text.trim().to_owned()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => HostKernel::default().release(),
            Err(e) => Err(io_err("reading", &path)(e)),
        }
    }

    /// Opens (or creates, with a fresh boot ID) the simulated kernel in `dir`.
    pub fn open(dir: impl Into<PathBuf>, release: impl Into<String>) -> Result<Self, KernelError> {
        let kernel = Self {
            dir: dir.into(),
            release: release.into(),
        };
        let modules = kernel.modules_dir();
        std::fs::create_dir_all(&modules).map_err(io_err("creating", &modules))?;
        if !kernel.dir.join("boot_id").exists() {
            kernel.new_boot_id()?;
        }
        Ok(kernel)
    }

    fn modules_dir(&self) -> PathBuf {
        self.dir.join("modules")
    }

    fn new_boot_id(&self) -> Result<(), KernelError> {
        let uuid = Path::new("/proc/sys/kernel/random/uuid");
        let id = std::fs::read_to_string(uuid).map_err(io_err("reading", uuid))?;
        let path = self.dir.join("boot_id");
        std::fs::write(&path, id.trim()).map_err(io_err("writing", &path))
    }

    /// A reboot: a new boot ID, no modules loaded, default firmware path.
    pub fn reboot(&self) -> Result<(), KernelError> {
        let modules = self.modules_dir();
        std::fs::remove_dir_all(&modules).map_err(io_err("removing", &modules))?;
        std::fs::create_dir_all(&modules).map_err(io_err("creating", &modules))?;
        let _ = std::fs::remove_file(self.dir.join("firmware_class_path"));
        self.new_boot_id()
    }

    /// Marks an in-tree module as loaded (as the node's own kernel would have it).
    pub fn add_in_tree(&self, name: &str) -> Result<(), KernelError> {
        self.write(&SimulatedModule {
            name: normalize_module_name(name),
            path: None,
            depends: vec![],
            parameters: vec![],
            in_tree: true,
        })
    }

    /// The loaded module `name`, if any.
    pub fn module(&self, name: &str) -> Result<Option<SimulatedModule>, KernelError> {
        let path = self.module_path(name);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| KernelError::Refused(format!("{}: {e}", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("reading", &path)(e)),
        }
    }

    /// What `/sys/module/firmware_class/parameters/path` holds.
    pub fn firmware_class_path(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join("firmware_class_path")).ok()
    }

    fn module_path(&self, name: &str) -> PathBuf {
        self.modules_dir()
            .join(format!("{}.json", normalize_module_name(name)))
    }

    fn write(&self, module: &SimulatedModule) -> Result<(), KernelError> {
        let path = self.module_path(&module.name);
        let bytes = serde_json::to_vec(module).expect("serialises");
        std::fs::write(&path, bytes).map_err(io_err("writing", &path))?;
        self.log(KernelLogEvent::Insert, &module.name)
    }

    /// Appends to the kernel log: what a real kernel's log says about module loads,
    /// stamped with the machine's clock so that the logs of a fleet's simulated nodes
    /// merge into one order of events.
    fn log(&self, event: KernelLogEvent, module: &str) -> Result<(), KernelError> {
        use std::io::Write;
        let path = self.dir.join(KERNEL_LOG);
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let line = format!("{at} {} {module}\n", event.word());
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut file| file.write_all(line.as_bytes()))
            .map_err(io_err("appending to", &path))
    }

    fn all(&self) -> Result<Vec<SimulatedModule>, KernelError> {
        let mut out = vec![];
        for name in self.loaded_modules()? {
            if let Some(m) = self.module(&name)? {
                out.push(m);
            }
        }
        Ok(out)
    }

    fn load(&self, dir: &str, module: &str, parameters: &[String]) -> Result<(), KernelError> {
        let chain = resolve_with_dry_run(Path::new(dir), &self.release, module, parameters)?;
        if chain.is_empty() {
            return Err(KernelError::Refused(format!(
                "modprobe: FATAL: Module {module} not found in directory {dir}/lib/modules/{}",
                self.release
            )));
        }
        if let Some(missing) = chain.iter().find(|insmod| !insmod.path.is_file()) {
            return Err(KernelError::Refused(format!(
                "modprobe: could not insert '{}': {} is missing from the image",
                missing.name,
                missing.path.display()
            )));
        }
        let paths: Vec<&Path> = chain.iter().map(|insmod| insmod.path.as_path()).collect();
        let infos = modinfo(&paths)?;
        let loaded = self.loaded_modules()?;
        let mut available: BTreeSet<String> = loaded.clone();
        let mut to_write = vec![];
        for (insmod, info) in chain.iter().zip(infos) {
            if info.built_for != self.release {
                return Err(KernelError::Refused(format!(
                    "modprobe: ERROR: could not insert '{}': Exec format error \
                     (module built for kernel {}, the node runs {})",
                    insmod.name, info.built_for, self.release
                )));
            }
            let depends: Vec<String> = info
                .depends
                .iter()
                .map(|d| normalize_module_name(d))
                .collect();
            if let Some(missing) = depends.iter().find(|d| !available.contains(*d)) {
                return Err(KernelError::Refused(format!(
                    "modprobe: ERROR: could not insert '{}': Unknown symbol in module \
                     (it depends on {missing}, which is neither loaded nor in the image)",
                    insmod.name
                )));
            }
            available.insert(insmod.name.clone());
            if !loaded.contains(&insmod.name) {
                to_write.push(SimulatedModule {
                    name: insmod.name.clone(),
                    path: Some(insmod.path.clone()),
                    depends,
                    parameters: insmod.parameters.clone(),
                    in_tree: false,
                });
            }
        }
        for module in &to_write {
            self.write(module)?;
        }
        Ok(())
    }

    fn unload(&self, module: &str, with_dependencies: bool) -> Result<(), KernelError> {
        let name = normalize_module_name(module);
        let Some(record) = self.module(&name)? else {
            return Err(KernelError::Refused(format!(
                "modprobe: FATAL: Module {name} is not in kernel."
            )));
        };
        if let Some(holder) = self.all()?.iter().find(|m| m.depends.contains(&name)) {
            return Err(KernelError::Refused(format!(
                "modprobe: FATAL: Module {name} is in use (by {}).",
                holder.name
            )));
        }
        let path = self.module_path(&name);
        std::fs::remove_file(&path).map_err(io_err("removing", &path))?;
        self.log(KernelLogEvent::Remove, &name)?;
        if with_dependencies {
            // Like modprobe -r: dependencies go too when nothing else uses them.
            for dep in record.depends.iter().rev() {
                let used = self.all()?.iter().any(|m| m.depends.contains(dep));
                if !used && self.module(dep)?.is_some_and(|m| !m.in_tree) {
                    self.unload(dep, true)?;
                }
            }
        }
        Ok(())
    }
}

impl Kernel for SimulatedKernel {
    fn backend(&self) -> &'static str {
        "simulated"
    }

    fn boot_id(&self) -> Result<String, KernelError> {
        let path = self.dir.join("boot_id");
        std::fs::read_to_string(&path)
            .map(|s| s.trim().to_string())
            .map_err(io_err("reading", &path))
    }

    fn release(&self) -> Result<String, KernelError> {
        Ok(self.release.clone())
    }

    fn loaded_modules(&self) -> Result<BTreeSet<String>, KernelError> {
        let dir = self.modules_dir();
        let mut out = BTreeSet::new();
        for entry in std::fs::read_dir(&dir).map_err(io_err("reading", &dir))? {
            let entry = entry.map_err(io_err("reading", &dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(stem) = name.strip_suffix(".json") {
                out.insert(stem.to_string());
            }
        }
        Ok(out)
    }

    fn modprobe(&self, command: &ModprobeCommand) -> Result<(), KernelError> {
        let parsed = parse_command(&command.args);
        if parsed.remove {
            for module in &parsed.modules {
                self.unload(module, true)?;
            }
            return Ok(());
        }
        let Some(dir) = parsed.dir.as_deref() else {
            return Err(KernelError::Refused(
                "simulated kernel: modprobe without -d would load the node's own modules".into(),
            ));
        };
        let [module] = parsed.modules.as_slice() else {
            return Err(KernelError::Refused(format!(
                "simulated kernel: expected one module to load in {:?}",
                command.args
            )));
        };
        self.load(dir, module, &parsed.parameters)
    }

    /// In-tree modules are left out: like this backend's `modprobe -r`, an unload never
    /// takes them as dependencies.
    fn module_users(&self) -> Result<Users, KernelError> {
        let modules = self.all()?;
        let mut users: Users = modules
            .iter()
            .filter(|m| !m.in_tree)
            .map(|m| (m.name.clone(), Default::default()))
            .collect();
        for module in &modules {
            for dependency in &module.depends {
                if let Some(by) = users.get_mut(dependency) {
                    by.insert(module.name.clone());
                }
            }
        }
        Ok(users)
    }

    fn remove_module(&self, module: &str) -> Result<(), KernelError> {
        self.unload(module, false)
    }

    fn remove_in_tree(&self, module: &str) -> Result<(), KernelError> {
        self.unload(module, false)
    }

    fn set_firmware_class_path(&self, dir: &Path) -> Result<(), KernelError> {
        let path = self.dir.join("firmware_class_path");
        std::fs::write(&path, dir.as_os_str().as_encoded_bytes()).map_err(io_err("writing", &path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_log_records_inserts_and_removals_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = SimulatedKernel::open(dir.path().join("node"), "6.1.0-56-amd64").unwrap();
        kernel.add_in_tree("in-tree").unwrap();
        kernel.unload("in-tree", false).unwrap();
        let log = std::fs::read_to_string(dir.path().join("node").join(KERNEL_LOG)).unwrap();
        let lines: Vec<(u128, &str)> = log
            .lines()
            .map(|line| {
                let (at, rest) = line.split_once(' ').unwrap();
                (at.parse().unwrap(), rest)
            })
            .collect();
        assert_eq!(
            lines.iter().map(|(_, e)| *e).collect::<Vec<_>>(),
            ["insert in_tree", "remove in_tree"]
        );
        assert!(lines[0].0 <= lines[1].0, "{log}");
    }

    #[test]
    fn boot_ids_and_in_tree_modules() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = SimulatedKernel::open(dir.path().join("node"), "6.1.0-56-amd64").unwrap();
        let first = kernel.boot_id().unwrap();
        // Reopening keeps the boot; a reboot changes it and empties the kernel.
        let again = SimulatedKernel::open(dir.path().join("node"), "6.1.0-56-amd64").unwrap();
        assert_eq!(again.boot_id().unwrap(), first);
        kernel.add_in_tree("in-tree").unwrap();
        assert!(kernel.loaded_modules().unwrap().contains("in_tree"));
        kernel.remove_in_tree("in_tree").unwrap();
        assert!(kernel.loaded_modules().unwrap().is_empty());
        let err = kernel.remove_in_tree("in_tree").unwrap_err();
        assert!(err.to_string().contains("not in kernel"), "{err}");
        kernel.add_in_tree("x").unwrap();
        kernel.set_firmware_class_path(Path::new("/fw")).unwrap();
        kernel.reboot().unwrap();
        assert_ne!(kernel.boot_id().unwrap(), first);
        assert!(kernel.loaded_modules().unwrap().is_empty());
        assert_eq!(kernel.firmware_class_path(), None);
    }

    #[test]
    fn the_release_is_the_nodes_release_file_or_the_machines() {
        let dir = tempfile::tempdir().unwrap();
        let machine = HostKernel::default().release().unwrap();
        assert_eq!(SimulatedKernel::node_release(dir.path()).unwrap(), machine);
        let absent = dir.path().join("not-created-yet");
        assert_eq!(SimulatedKernel::node_release(&absent).unwrap(), machine);

        let file = dir.path().join("release");
        std::fs::write(&file, "6.1.0-56-amd64\n").unwrap();
        assert_eq!(
            SimulatedKernel::node_release(dir.path()).unwrap(),
            "6.1.0-56-amd64"
        );
        std::fs::write(&file, " \n").unwrap();
        let err = SimulatedKernel::node_release(dir.path()).unwrap_err();
        assert!(
            err.to_string().contains(&file.display().to_string())
                && err.to_string().contains("empty"),
            "{err}"
        );
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir(&file).unwrap();
        let err = SimulatedKernel::node_release(dir.path()).unwrap_err();
        assert!(matches!(err, KernelError::Io { .. }), "{err}");
    }

    #[test]
    fn loading_needs_a_module_directory() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = SimulatedKernel::open(dir.path(), "k").unwrap();
        let err = kernel
            .modprobe(&ModprobeCommand {
                args: vec!["m".into()],
            })
            .unwrap_err();
        assert!(err.to_string().contains("without -d"), "{err}");
    }
}
