//! The shared libraries a host program needs in the guest, from `ldd`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Error, IoContext, Result};

/// The libraries (and the dynamic loader) `program` loads, as the paths the loader
/// looks them up by; the guest gets each at the same path.
pub fn of(program: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(program)
        .output()
        .context(|| format!("running ldd {}", program.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    // A static program makes ldd exit 1 saying so; that is no libraries, not an error.
    if !out.status.success() {
        if String::from_utf8_lossy(&out.stderr).contains("not a dynamic executable") {
            return Ok(vec![]);
        }
        return Err(Error::Command {
            command: format!("ldd {}", program.display()),
            status: format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr)),
        });
    }
    parse(&text).map_err(|line| {
        Error::Invalid(format!(
            "ldd {}: cannot use `{line}` (a library is missing on this machine)",
            program.display()
        ))
    })
}

/// Paths from `ldd` output; `Err(line)` for a library ldd could not find.
fn parse(ldd: &str) -> std::result::Result<Vec<PathBuf>, String> {
    let mut paths = vec![];
    for line in ldd.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let target = match line.split_once("=>") {
            Some((_, target)) => target.trim(),
            None => line,
        };
        if target.starts_with("not found") {
            return Err(line.to_string());
        }
        let path = target.split(" (").next().unwrap_or_default().trim();
        // The vDSO and "statically linked" lines name no file.
        if path.starts_with('/') {
            paths.push(PathBuf::from(path));
        }
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libraries_and_the_loader_are_listed_the_vdso_is_not() {
        let ldd = "\tlinux-vdso.so.1 (0x00007ffc6b1f2000)\n\
                   \tlibzstd.so.1 => /lib/x86_64-linux-gnu/libzstd.so.1 (0x00007f3c2a000000)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f3c29e00000)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f3c2a1a0000)\n";
        assert_eq!(
            parse(ldd).unwrap(),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libzstd.so.1"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
    }

    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        let ldd = "\tlibfoo.so.9 => not found\n\tlibc.so.6 => /lib/libc.so.6 (0x1)\n";
        assert_eq!(parse(ldd).unwrap_err(), "libfoo.so.9 => not found");
    }

    #[test]
    fn a_static_program_needs_nothing() {
        assert!(parse("\tstatically linked\n").unwrap().is_empty());
    }
}
