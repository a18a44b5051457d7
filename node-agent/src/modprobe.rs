//! modprobe, depmod and modinfo from kmod: argument lists built as upstream KMM does
//! (pure, unit-tested) and the few checks shared by the simulated backend and
//! `check-image` (real dry-run resolution and vermagic).

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use wait_timeout::ChildExt as _;

use crate::desired::Modprobe;

/// A modprobe invocation: everything after `modprobe`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModprobeCommand {
    pub args: Vec<String>,
}

/// The arguments that load `module` from `module_dir` (the image's `dirName`,
/// extracted): `-d <dir> [args.load] <module> [parameters]`, parameters only for
/// `moduleName`. With `rawArgs.load` the raw arguments are used instead, with a
/// `-d`/`--dirname` value rewritten to lie inside the extracted image.
pub fn load_command(
    settings: &Modprobe,
    module_dir: &Path,
    image_root: &Path,
    module: &str,
) -> ModprobeCommand {
    if let Some(raw) = settings.raw_args.as_ref().filter(|r| !r.load.is_empty()) {
        return ModprobeCommand {
            args: rewrite_dirname(&raw.load, image_root),
        };
    }
    let mut args = vec!["-d".to_string(), module_dir.display().to_string()];
    if let Some(extra) = &settings.args {
        args.extend(extra.load.iter().cloned());
    }
    args.push(module.to_string());
    if settings.module_name.as_deref() == Some(module) {
        args.extend(settings.parameters.iter().cloned());
    }
    ModprobeCommand { args }
}

/// The arguments that unload `module`: `-r -d <dir> [args.unload] <module>`, or
/// `rawArgs.unload` (rewritten like [`load_command`]).
pub fn unload_command(
    settings: &Modprobe,
    module_dir: &Path,
    image_root: &Path,
    module: &str,
) -> ModprobeCommand {
    if let Some(raw) = settings.raw_args.as_ref().filter(|r| !r.unload.is_empty()) {
        return ModprobeCommand {
            args: rewrite_dirname(&raw.unload, image_root),
        };
    }
    let mut args = vec![
        "-r".to_string(),
        "-d".to_string(),
        module_dir.display().to_string(),
    ];
    if let Some(extra) = &settings.args {
        args.extend(extra.unload.iter().cloned());
    }
    args.push(module.to_string());
    ModprobeCommand { args }
}

/// True when raw arguments replace the computed ones for loading.
pub fn uses_raw_load(settings: &Modprobe) -> bool {
    settings
        .raw_args
        .as_ref()
        .is_some_and(|r| !r.load.is_empty())
}

fn inside(image_root: &Path, dir: &str) -> String {
    image_root
        .join(dir.trim_start_matches('/'))
        .display()
        .to_string()
}

fn rewrite_dirname(raw: &[String], image_root: &Path) -> Vec<String> {
    let mut out = Vec::with_capacity(raw.len());
    let mut iter = raw.iter();
    while let Some(arg) = iter.next() {
        if arg == "-d" || arg == "--dirname" {
            out.push(arg.clone());
            if let Some(dir) = iter.next() {
                out.push(inside(image_root, dir));
            }
        } else if let Some(dir) = arg.strip_prefix("--dirname=") {
            out.push(format!("--dirname={}", inside(image_root, dir)));
        } else if let Some(dir) = arg.strip_prefix("-d").filter(|d| !d.is_empty()) {
            out.push(format!("-d{}", inside(image_root, dir)));
        } else {
            out.push(arg.clone());
        }
    }
    out
}

/// A parsed modprobe command line, as the simulated backend interprets it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedCommand {
    pub remove: bool,
    pub dir: Option<String>,
    pub modules: Vec<String>,
    pub parameters: Vec<String>,
}

/// Interprets modprobe arguments: options, then a module name and its parameters (or,
/// with `-r`/`-a`, several module names).
pub fn parse_command(args: &[String]) -> ParsedCommand {
    let mut parsed = ParsedCommand::default();
    let mut all = false;
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "-r" | "--remove" => parsed.remove = true,
            "-a" | "--all" => all = true,
            "-d" | "--dirname" => parsed.dir = iter.next().cloned(),
            "-S" | "--set-version" | "-C" | "--config" => {
                iter.next();
            }
            a if a.starts_with("--dirname=") => parsed.dir = Some(a["--dirname=".len()..].into()),
            a if a.starts_with('-') => {
                if let Some(rest) = a
                    .strip_prefix("-d")
                    .filter(|r| !r.is_empty() && !a.starts_with("--"))
                {
                    parsed.dir = Some(rest.into());
                } else if a.len() > 2 && !a.starts_with("--") && a.contains('r') {
                    parsed.remove = true;
                }
            }
            name if parsed.modules.is_empty() || parsed.remove || all => {
                parsed.modules.push(name.to_string())
            }
            parameter => parsed.parameters.push(parameter.to_string()),
        }
    }
    parsed
}

#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("running {command}: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{command} failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("{command} did not finish within {}s and was killed (a module stuck in the kernel?)", .limit.as_secs())]
    TimedOut { command: String, limit: Duration },
    #[error("{command}: {why}")]
    Unexpected { command: String, why: String },
}

/// Where the agent sees the host's module tree (its DaemonSet mounts the host's
/// `/lib/modules` there, read-only): what upstream's in-tree dependency link in an image
/// (`<dirName>/lib/modules/<kernel>/<name> -> /lib/modules/<kernel>`) is written to reach.
pub const HOST_MODULES: &str = "/lib/modules";

/// How long a kmod tool may run: a `modprobe` stuck in a module's init or exit is
/// reported as a failure (and retried later) instead of holding the agent forever.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs a kmod tool and returns its standard output; killed after [`TOOL_TIMEOUT`].
pub fn run_tool(program: &str, args: &[String]) -> Result<String, ToolError> {
    run_tool_within(program, args, TOOL_TIMEOUT)
}

/// [`run_tool`] with a limit of `limit`.
pub fn run_tool_within(
    program: &str,
    args: &[String],
    limit: Duration,
) -> Result<String, ToolError> {
    let command = format!("{program} {}", args.join(" "));
    tracing::debug!(%command, "running");
    let spawn_error = |source| ToolError::Spawn {
        command: command.clone(),
        source,
    };
    let mut child = Command::new(program)
        .args(args)
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_error)?;
    // Read both pipes while waiting: a tool that fills one would otherwise never exit.
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let Some(status) = child.wait_timeout(limit).map_err(spawn_error)? else {
        // A process in uninterruptible sleep outlives SIGKILL: neither waited for nor
        // its pipes, so the agent goes on.
        let _ = child.kill();
        std::thread::spawn(move || child.wait());
        return Err(ToolError::TimedOut { command, limit });
    };
    let stdout = String::from_utf8_lossy(&stdout.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&stderr.join().unwrap_or_default())
        .trim()
        .to_string();
    if !status.success() {
        return Err(ToolError::Failed {
            command,
            status: status.to_string(),
            stderr: if stderr.is_empty() {
                stdout.trim().to_string()
            } else {
                stderr
            },
        });
    }
    Ok(stdout)
}

/// `depmod -b <dir> <kernel>` when `<dir>/lib/modules/<kernel>/modules.dep` is missing.
pub fn depmod_if_needed(module_dir: &Path, kernel: &str) -> Result<bool, ToolError> {
    let dep = module_dir
        .join("lib/modules")
        .join(kernel)
        .join("modules.dep");
    if dep.is_file() {
        return Ok(false);
    }
    run_tool(
        "depmod",
        &["-b".into(), module_dir.display().to_string(), kernel.into()],
    )?;
    Ok(true)
}

/// One `insmod` modprobe would run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Insmod {
    pub path: PathBuf,
    pub name: String,
    pub parameters: Vec<String>,
}

/// The module name of a `.ko` path (`foo-bar.ko.zst` => `foo_bar`).
pub fn module_name_of(path: &Path) -> String {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy())
        .unwrap_or_default();
    let stem = file.split(".ko").next().unwrap_or(&file);
    stem.replace('-', "_")
}

/// Parses `modprobe --dry-run -v` output: `insmod <path> [parameters]` lines.
pub fn parse_dry_run(output: &str) -> Vec<Insmod> {
    output
        .lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("insmod ")?;
            let mut words = rest.split_whitespace();
            let path = PathBuf::from(words.next()?);
            Some(Insmod {
                name: module_name_of(&path),
                parameters: words.map(str::to_string).collect(),
                path,
            })
        })
        .collect()
}

/// Real `modprobe --dry-run -v --show-depends -d <dir> -S <kernel> <module>`: the
/// modules, dependencies first, that loading `module` would insert, whether or not the
/// running kernel has them loaded.
pub fn resolve_with_dry_run(
    module_dir: &Path,
    kernel: &str,
    module: &str,
    parameters: &[String],
) -> Result<Vec<Insmod>, ToolError> {
    let mut args = vec![
        "--dry-run".to_string(),
        "-v".into(),
        "--show-depends".into(),
        "-d".into(),
        module_dir.display().to_string(),
        "-S".into(),
        kernel.into(),
        module.into(),
    ];
    args.extend(parameters.iter().cloned());
    let output = run_tool("modprobe", &args)?;
    Ok(parse_dry_run(&output))
}

/// What `modinfo` says about one module file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModuleInfo {
    /// The kernel release it was built for (the first word of its vermagic).
    pub built_for: String,
    /// The modules it depends on, as modinfo names them.
    pub depends: Vec<String>,
    /// Who signed it, when it is signed.
    pub signer: Option<String>,
}

/// `modinfo <path>...`: the fields of every file, in the order given, from one process
/// (a load checks a whole dependency chain, and every process costs milliseconds).
pub fn modinfo(paths: &[&Path]) -> Result<Vec<ModuleInfo>, ToolError> {
    if paths.is_empty() {
        return Ok(vec![]);
    }
    let args: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    let output = run_tool("modinfo", &args)?;
    let infos = parse_modinfo(&output);
    if infos.len() != paths.len() {
        return Err(ToolError::Unexpected {
            command: format!("modinfo {}", args.join(" ")),
            why: format!(
                "described {} modules where {} were asked for",
                infos.len(),
                paths.len()
            ),
        });
    }
    Ok(infos)
}

/// Parses modinfo's output: every module starts with its `filename:` line; a line that
/// starts with whitespace continues the value above it (a signature's bytes).
pub fn parse_modinfo(output: &str) -> Vec<ModuleInfo> {
    let mut infos: Vec<ModuleInfo> = vec![];
    for line in output.lines() {
        if line.starts_with(char::is_whitespace) {
            continue;
        }
        let Some((field, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if field == "filename" {
            infos.push(ModuleInfo::default());
            continue;
        }
        let Some(info) = infos.last_mut() else {
            continue;
        };
        match field {
            "vermagic" if info.built_for.is_empty() => {
                info.built_for = value.split_whitespace().next().unwrap_or_default().into();
            }
            "depends" => info.depends.extend(
                value
                    .split(',')
                    .filter(|d| !d.is_empty())
                    .map(str::to_string),
            ),
            "signer" if !value.is_empty() => info.signer = Some(value.into()),
            _ => {}
        }
    }
    infos
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desired::ModprobeArgs;

    fn settings() -> Modprobe {
        Modprobe {
            module_name: Some("main".into()),
            parameters: vec!["a=1".into(), "b=2".into()],
            args: Some(ModprobeArgs {
                load: vec!["-v".into()],
                unload: vec!["-v".into()],
            }),
            ..Default::default()
        }
    }

    #[test]
    fn load_and_unload_commands() {
        let dir = Path::new("/cache/x/opt");
        let root = Path::new("/cache/x");
        assert_eq!(
            load_command(&settings(), dir, root, "main").args,
            ["-d", "/cache/x/opt", "-v", "main", "a=1", "b=2"]
        );
        // Parameters belong to moduleName only.
        assert_eq!(
            load_command(&settings(), dir, root, "dep").args,
            ["-d", "/cache/x/opt", "-v", "dep"]
        );
        assert_eq!(
            unload_command(&settings(), dir, root, "main").args,
            ["-r", "-d", "/cache/x/opt", "-v", "main"]
        );
        assert_eq!(
            load_command(&Modprobe::default(), dir, root, "m").args,
            ["-d", "/cache/x/opt", "m"]
        );
    }

    #[test]
    fn raw_args_replace_everything_and_stay_inside_the_image() {
        let mut s = settings();
        s.raw_args = Some(ModprobeArgs {
            load: vec![
                "-v".into(),
                "-d".into(),
                "/opt".into(),
                "main".into(),
                "x=1".into(),
            ],
            unload: vec!["-r".into(), "--dirname=/opt".into(), "main".into()],
        });
        let root = Path::new("/cache/x");
        assert!(uses_raw_load(&s));
        assert_eq!(
            load_command(&s, Path::new("/ignored"), root, "main").args,
            ["-v", "-d", "/cache/x/opt", "main", "x=1"]
        );
        assert_eq!(
            unload_command(&s, Path::new("/ignored"), root, "main").args,
            ["-r", "--dirname=/cache/x/opt", "main"]
        );
        assert_eq!(
            rewrite_dirname(&["-d/opt".into()], root),
            ["-d/cache/x/opt"]
        );
    }

    #[test]
    fn parses_commands() {
        let args: Vec<String> = ["-v", "-d", "/r", "m", "a=1"].map(String::from).to_vec();
        assert_eq!(
            parse_command(&args),
            ParsedCommand {
                remove: false,
                dir: Some("/r".into()),
                modules: vec!["m".into()],
                parameters: vec!["a=1".into()],
            }
        );
        let args: Vec<String> = ["-rv", "--dirname=/r", "m"].map(String::from).to_vec();
        let parsed = parse_command(&args);
        assert!(parsed.remove);
        assert_eq!(parsed.dir.as_deref(), Some("/r"));
        let args: Vec<String> = ["-r", "a", "b"].map(String::from).to_vec();
        assert_eq!(parse_command(&args).modules, ["a", "b"]);
    }

    #[test]
    fn parses_dry_run_output() {
        let out = "insmod /r/lib/modules/k/extra/kmm_hello.ko \n\
                   insmod /r/lib/modules/k/extra/kmm-hello_dep.ko.zst x=1 y=2\n\
                   builtin foo\n";
        let parsed = parse_dry_run(out);
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0].name, "kmm_hello");
        assert_eq!(parsed[1].name, "kmm_hello_dep");
        assert_eq!(parsed[1].parameters, ["x=1", "y=2"]);
    }

    #[test]
    fn a_tool_that_hangs_is_killed_and_reported() {
        let started = std::time::Instant::now();
        let error =
            run_tool_within("sleep", &["30".into()], Duration::from_millis(200)).unwrap_err();
        assert!(matches!(error, ToolError::TimedOut { .. }), "{error}");
        assert!(error.to_string().contains("sleep 30"), "{error}");
        assert!(started.elapsed() < Duration::from_secs(10));
        let output = run_tool_within("echo", &["done".into()], Duration::from_secs(10)).unwrap();
        assert_eq!(output.trim(), "done");
        let error = run_tool_within(
            "sh",
            &["-c".into(), "echo why >&2; exit 3".into()],
            Duration::from_secs(10),
        )
        .unwrap_err();
        assert!(error.to_string().contains("why"), "{error}");
    }

    #[test]
    fn modinfo_output_gives_each_module_its_fields() {
        let out = "filename:       /r/extra/kmm_hello_dep.ko\n\
                   depends:        kmm_hello,other\n\
                   name:           kmm_hello_dep\n\
                   vermagic:       6.1.0-55-amd64 SMP preempt mod_unload modversions \n\
                   parm:           who:whom it greets (charp)\n\
                   filename:       /r/extra/kmm_hello.ko\n\
                   depends:        \n\
                   vermagic:       6.1.0-56-amd64 SMP mod_unload \n\
                   signer:         kmm-fleet test key\n\
                   signature:      30:82:02:\n\
                   \t\tAB:CD:EF\n";
        let infos = parse_modinfo(out);
        assert_eq!(
            infos,
            [
                ModuleInfo {
                    built_for: "6.1.0-55-amd64".into(),
                    depends: vec!["kmm_hello".into(), "other".into()],
                    signer: None,
                },
                ModuleInfo {
                    built_for: "6.1.0-56-amd64".into(),
                    depends: vec![],
                    signer: Some("kmm-fleet test key".into()),
                },
            ]
        );
        assert!(parse_modinfo("").is_empty());
    }
}
