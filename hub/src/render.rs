//! `kmm-hub render`: what would a node on this kernel get? Answered before rolling out.

use std::{
    fmt::Write as _,
    io::{self, Read},
    path::PathBuf,
    process::ExitCode,
};

use clap::ValueEnum;
use kmm_resolver::{MatchedBy, Resolution, Resolver};

use crate::module_document::{self, ModuleDocument};

/// Exit code when every kernel resolved.
const EXIT_RESOLVED: u8 = 0;
/// Exit code when at least one kernel did not resolve.
const EXIT_UNRESOLVED: u8 = 1;
/// Exit code when the document could not be read, parsed or validated.
const EXIT_INVALID: u8 = 2;

/// Resolve a module for kernel releases and print what each node would load.
///
/// Reads a ManagedClusterModule (or an upstream Kernel Module Management Module) and, for
/// every --kernel, prints the kernel mapping that matches, the image with its variables
/// substituted, the merged build and sign settings, modprobe settings and in-tree modules
/// to remove. Exit status: 0 when every kernel resolves, 1 when at least one does not
/// (each reported on stderr with the kernel and the field at fault), 2 when the document
/// cannot be read or is invalid.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  kmm-hub render -f docs/examples/kmm-hello.yaml --kernel 6.1.0-13-amd64 --kernel 5.14.0-427.13.1.el9_4.x86_64"
)]
pub struct Args {
    /// The module document, YAML or JSON; `-` reads standard input.
    #[arg(short = 'f', long = "filename", value_name = "FILE")]
    file: PathBuf,

    /// A kernel release as nodes report it (`uname -r`); repeat for several.
    #[arg(short, long = "kernel", value_name = "RELEASE", required = true)]
    kernels: Vec<String>,

    /// Output format.
    #[arg(short, long, value_enum, default_value_t = Format::Json)]
    output: Format,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Format {
    /// One pretty-printed JSON object per kernel.
    Json,
    /// One compact JSON object per line.
    Jsonl,
    /// A short human summary per kernel.
    Text,
}

pub fn run(args: &Args) -> ExitCode {
    let document = match read(&args.file).and_then(|text| module_document::parse(&text)) {
        Ok(document) => document,
        Err(message) => {
            eprintln!("error: {}: {message}", args.file.display());
            return ExitCode::from(EXIT_INVALID);
        }
    };
    let resolver = match Resolver::new(&document.spec, document.identity()) {
        Ok(resolver) => resolver,
        Err(errors) => {
            eprintln!(
                "error: {} {:?} is invalid ({} problem{}):",
                document.kind,
                document.name,
                errors.0.len(),
                if errors.0.len() == 1 { "" } else { "s" }
            );
            for error in &errors.0 {
                eprintln!("  {error}");
            }
            return ExitCode::from(EXIT_INVALID);
        }
    };
    if document.spec.module_loader.is_none() {
        // Only a device plugin: no kernel selects anything, every selected node runs it.
        for kernel in &args.kernels {
            println!("{}", plugin_only(kernel, &document, args.output));
        }
        return ExitCode::from(EXIT_RESOLVED);
    }
    let mut status = EXIT_RESOLVED;
    for kernel in &args.kernels {
        match resolver.resolve(kernel) {
            Ok(resolution) => println!("{}", format(&resolution, &document, args.output)),
            Err(error) => {
                eprintln!("error: {error}");
                status = EXIT_UNRESOLVED;
            }
        }
    }
    ExitCode::from(status)
}

fn read(path: &PathBuf) -> Result<String, String> {
    let mut text = String::new();
    let result = if path.as_os_str() == "-" {
        io::stdin().read_to_string(&mut text).map(|_| ())
    } else {
        std::fs::read_to_string(path).map(|t| text = t)
    };
    result
        .map(|()| text)
        .map_err(|e| format!("cannot read: {e}"))
}

fn format(resolution: &Resolution, document: &ModuleDocument, format: Format) -> String {
    match format {
        Format::Json => serde_json::to_string_pretty(resolution).expect("serializable"),
        Format::Jsonl => serde_json::to_string(resolution).expect("serializable"),
        Format::Text => text(resolution, document),
    }
}

/// What a node on `kernel` gets from a module with only a device plugin: its plugin Pod,
/// and nothing to load.
fn plugin_only(kernel: &str, document: &ModuleDocument, format: Format) -> String {
    let answer = serde_json::json!({
        "kernel": kernel,
        "devicePluginOnly": true,
    });
    match format {
        Format::Json => serde_json::to_string_pretty(&answer).expect("serializable"),
        Format::Jsonl => answer.to_string(),
        Format::Text => format!(
            "{} {}/{} on kernel {kernel}\n  load         nothing (no moduleLoader)\n  \
             device plugin runs on every selected node, whatever its kernel\n",
            document.kind, document.namespace, document.name
        ),
    }
}

fn text(r: &Resolution, document: &ModuleDocument) -> String {
    let mut out = String::new();
    let mapping = match &r.matched_by {
        MatchedBy::Literal(literal) => format!("literal {literal:?}"),
        MatchedBy::Regexp(pattern) => format!("regexp {pattern:?}"),
    };
    let modprobe = &r.modprobe;
    let dir = modprobe.dir_name.as_deref().unwrap_or_default();
    let load = match (&modprobe.raw_args, &modprobe.module_name) {
        (Some(raw), _) if raw.load.is_some() => {
            format!(
                "modprobe {}",
                raw.load.clone().unwrap_or_default().join(" ")
            )
        }
        (_, name) => {
            let mut words = vec!["modprobe".to_owned(), "-d".to_owned(), dir.to_owned()];
            words.extend(
                modprobe
                    .args
                    .iter()
                    .flat_map(|a| a.load.clone().unwrap_or_default()),
            );
            words.push(name.clone().unwrap_or_default());
            words.extend(modprobe.parameters.clone().unwrap_or_default());
            words.join(" ")
        }
    };
    let _ = writeln!(
        out,
        "{} {}/{} on kernel {}",
        document.kind, document.namespace, document.name, r.kernel
    );
    let _ = writeln!(out, "  mapping      #{} ({mapping})", r.mapping_index);
    let _ = writeln!(out, "  image        {}", r.container_image);
    let _ = writeln!(out, "  load         {load}");
    if let Some(order) = &modprobe.modules_loading_order {
        let _ = writeln!(out, "  order        {}", order.join(" -> "));
    }
    if let Some(firmware) = &modprobe.firmware_path {
        let _ = writeln!(out, "  firmware     {firmware}");
    }
    if !r.in_tree_modules_to_remove.is_empty() {
        let _ = writeln!(
            out,
            "  remove first {}",
            r.in_tree_modules_to_remove.join(", ")
        );
    }
    if let Some(version) = &r.version {
        let _ = writeln!(out, "  version      {version}");
    }
    if let Some(build) = &r.build {
        let _ = writeln!(
            out,
            "  build        Dockerfile from ConfigMap {}",
            build.dockerfile_config_map.name
        );
    }
    if let Some(sign) = &r.sign {
        let files = sign.files_to_sign.clone().unwrap_or_default().join(", ");
        let _ = writeln!(
            out,
            "  sign         {files} (key Secret {})",
            sign.key_secret.name
        );
    }
    let variables: Vec<String> = r
        .variables
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if !variables.is_empty() {
        let _ = writeln!(out, "  variables    {}", variables.join(" "));
    }
    out
}
