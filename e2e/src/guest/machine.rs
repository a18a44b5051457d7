//! One boot of the guest under qemu-system-x86_64: KVM when `/dev/kvm` is usable,
//! software emulation otherwise. The console (kernel log) goes to a file; the second
//! serial port is the command channel ([`super::channel`]) on a Unix socket this process
//! listens on and qemu connects to.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::process::{Child, Command};

use super::channel::{self, Frame};
use crate::process::run;
use crate::{Error, IoContext, Result};

/// Longest wait for the guest to boot under software emulation (2 busy cores included).
const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest wait under KVM, which boots in about a second where it works; nested KVM
/// may hang instead (seen inside Firecracker VMs), so the caller falls back to TCG.
pub const KVM_BOOT_TIMEOUT: Duration = Duration::from_secs(20);

/// How to boot.
#[derive(Debug, Clone)]
pub struct BootSpec {
    pub vmlinuz: PathBuf,
    pub initramfs: PathBuf,
    /// A raw ext4 image, `/dev/vda` in the guest, mounted at `/persist`.
    pub disk: PathBuf,
    /// Kernel command line besides the console and panic settings.
    pub kernel_args: Vec<String>,
    pub memory_mib: u32,
    /// Directory for the console log and the channel's socket.
    pub dir: PathBuf,
    /// Names this boot's files (`<name>.console.log`).
    pub name: String,
    pub firmware: Firmware,
}

/// What starts the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Firmware {
    /// qemu's default PC and its SeaBIOS, which starts `-kernel` directly.
    Bios,
    /// A q35 PC with OVMF, which starts `-kernel` through the kernel's EFI stub: the
    /// kernel then reads UEFI variables, `db` among them. `code` is mapped read-only;
    /// `vars` is this guest's own variable store, which the firmware writes to.
    Uefi { code: PathBuf, vars: PathBuf },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accelerator {
    Kvm,
    /// Software emulation.
    Tcg,
}

impl Accelerator {
    /// KVM when this process may open `/dev/kvm` read-write (whether it really works
    /// shows only by booting).
    pub fn detect() -> Self {
        let usable = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok();
        if usable { Self::Kvm } else { Self::Tcg }
    }
}

/// The qemu command line for `spec`.
fn qemu_args(spec: &BootSpec, accel: Accelerator, console: &Path, socket: &Path) -> Vec<String> {
    let (accel, cpu) = match accel {
        Accelerator::Kvm => ("kvm", "host"),
        Accelerator::Tcg => ("tcg", "max"),
    };
    let mut append = vec!["console=ttyS0".to_string(), "panic=-1".to_string()];
    append.extend(spec.kernel_args.iter().cloned());
    let firmware: Vec<String> = match &spec.firmware {
        Firmware::Bios => vec![],
        // OVMF's flash is two pflash devices, code first. q35 is the PC this boot was
        // measured on (docs: e2e/README.md).
        Firmware::Uefi { code, vars } => vec![
            "-machine".into(),
            "q35".into(),
            "-drive".into(),
            format!("if=pflash,format=raw,readonly=on,file={}", code.display()),
            "-drive".into(),
            format!("if=pflash,format=raw,file={}", vars.display()),
        ],
    };
    let mut args: Vec<String> = vec![
        "-accel".into(),
        accel.into(),
        "-cpu".into(),
        cpu.into(),
        "-smp".into(),
        "2".into(),
        "-m".into(),
        format!("{}M", spec.memory_mib),
        "-nodefaults".into(),
        "-display".into(),
        "none".into(),
        // A kernel panic or reboot ends qemu instead of looping.
        "-no-reboot".into(),
        "-kernel".into(),
        spec.vmlinuz.display().to_string(),
        "-initrd".into(),
        spec.initramfs.display().to_string(),
        "-append".into(),
        append.join(" "),
        "-serial".into(),
        format!("file:{}", console.display()),
        "-chardev".into(),
        format!("socket,id=channel,path={},server=off", socket.display()),
        "-serial".into(),
        "chardev:channel".into(),
        "-netdev".into(),
        "user,id=net0".into(),
        "-device".into(),
        "virtio-net-pci,netdev=net0".into(),
        "-drive".into(),
        format!("file={},format=raw,if=virtio", spec.disk.display()),
    ];
    args.extend(firmware);
    args
}

/// An empty ext4 disk image of `mib` MiB at `path`.
pub fn create_disk(path: &Path, mib: u64) -> Result<()> {
    let file = std::fs::File::create(path).context(|| format!("creating {}", path.display()))?;
    file.set_len(mib * 1024 * 1024)
        .context(|| format!("sizing {}", path.display()))?;
    run(std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(path))?;
    Ok(())
}

/// The result of a command run in the guest.
#[derive(Debug, Clone)]
pub struct Output {
    pub code: i32,
    pub output: String,
}

/// A running guest.
#[derive(Debug)]
pub struct Machine {
    qemu: Child,
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    next_id: u64,
    console: PathBuf,
    /// From starting qemu to the guest's init reporting ready.
    pub boot_time: Duration,
    /// The guest's own uptime when its init reported ready.
    pub guest_uptime: Duration,
    pub accelerator: Accelerator,
}

impl Machine {
    pub async fn boot(spec: &BootSpec, accelerator: Accelerator) -> Result<Self> {
        let timeout = match accelerator {
            Accelerator::Kvm => KVM_BOOT_TIMEOUT,
            Accelerator::Tcg => BOOT_TIMEOUT,
        };
        let console = spec.dir.join(format!("{}.console.log", spec.name));
        let socket = spec.dir.join(format!("{}.channel.sock", spec.name));
        let _ = std::fs::remove_file(&socket);
        let listener =
            UnixListener::bind(&socket).context(|| format!("listening on {}", socket.display()))?;
        let started = Instant::now();
        let mut qemu = Command::new("qemu-system-x86_64")
            .args(qemu_args(spec, accelerator, &console, &socket))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context(|| {
                "starting qemu-system-x86_64 (Debian package qemu-system-x86)".to_string()
            })?;
        let stream = tokio::select! {
            accepted = tokio::time::timeout(timeout, listener.accept()) => match accepted {
                Ok(Ok((stream, _))) => stream,
                Ok(Err(e)) => return Err(Error::Io { context: "accepting qemu's channel".into(), source: e }),
                Err(_) => return Err(Error::Timeout { what: "qemu to connect its serial channel".into(), seconds: timeout.as_secs() }),
            },
            status = qemu.wait() => return Err(qemu_exited(&mut qemu, status, &console).await),
        };
        let (read, writer) = stream.into_split();
        let mut machine = Self {
            qemu,
            reader: BufReader::new(read),
            writer,
            next_id: 0,
            console,
            boot_time: Duration::ZERO,
            guest_uptime: Duration::ZERO,
            accelerator,
        };
        let deadline = started + timeout;
        let uptime = loop {
            match machine.next_frame(deadline, "the guest to boot").await? {
                Frame::Ready { uptime_seconds } => break uptime_seconds,
                Frame::Failed(why) => {
                    return Err(Error::Invalid(format!(
                        "the guest's init failed: {why}\nconsole:\n{}",
                        machine.console_tail(40)
                    )));
                }
                Frame::Output { .. } => {}
            }
        };
        machine.boot_time = started.elapsed();
        machine.guest_uptime = Duration::from_secs_f64(uptime);
        Ok(machine)
    }

    /// Run a shell command in the guest (as root, by its init) and return its exit code
    /// and combined output.
    pub async fn run(&mut self, command: &str, timeout: Duration) -> Result<Output> {
        self.next_id += 1;
        let id = self.next_id;
        self.writer
            .write_all(channel::request(id, command).as_bytes())
            .await
            .context(|| "writing to the guest's channel".into())?;
        let deadline = Instant::now() + timeout;
        loop {
            match self
                .next_frame(deadline, &format!("`{command}` in the guest"))
                .await?
            {
                Frame::Output {
                    id: done,
                    code,
                    output,
                } if done == id => return Ok(Output { code, output }),
                Frame::Failed(why) => {
                    return Err(Error::Invalid(format!("the guest's init failed: {why}")));
                }
                _ => {}
            }
        }
    }

    /// Run a command that must succeed; its output.
    pub async fn check(&mut self, command: &str) -> Result<String> {
        let out = self.run(command, Duration::from_secs(60)).await?;
        if out.code != 0 {
            return Err(Error::Command {
                command: format!("(guest) {command}"),
                status: format!("exit code {}: {}", out.code, out.output.trim()),
            });
        }
        Ok(out.output)
    }

    /// Power the guest off and wait for qemu to exit.
    pub async fn poweroff(mut self) -> Result<()> {
        // No answer comes: the guest is gone before it could write one.
        self.writer
            .write_all(channel::request(0, "sync; poweroff -f").as_bytes())
            .await
            .context(|| "writing to the guest's channel".into())?;
        match tokio::time::timeout(Duration::from_secs(30), self.qemu.wait()).await {
            Ok(status) => {
                status.context(|| "waiting for qemu".into())?;
                Ok(())
            }
            Err(_) => Err(Error::Timeout {
                what: "the guest to power off".into(),
                seconds: 30,
            }),
        }
    }

    /// The last `lines` of the guest's console (kernel log and init messages).
    pub fn console_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.console).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    async fn next_frame(&mut self, deadline: Instant, what: &str) -> Result<Frame> {
        loop {
            let mut line = String::new();
            let remaining = deadline.saturating_duration_since(Instant::now());
            let read = tokio::select! {
                read = tokio::time::timeout(remaining, self.reader.read_line(&mut line)) => read,
                status = self.qemu.wait() => {
                    return Err(qemu_exited(&mut self.qemu, status, &self.console).await);
                }
            };
            match read {
                Err(_) => {
                    return Err(Error::Timeout {
                        what: format!("{what}; console:\n{}", self.console_tail(30)),
                        seconds: remaining.as_secs(),
                    });
                }
                Ok(Err(e)) => {
                    return Err(Error::Io {
                        context: "reading the guest's channel".into(),
                        source: e,
                    });
                }
                Ok(Ok(0)) => {
                    // qemu closes the channel when it dies: say why, from its stderr.
                    let exit = tokio::time::timeout(Duration::from_secs(5), self.qemu.wait());
                    if let Ok(status) = exit.await {
                        return Err(qemu_exited(&mut self.qemu, status, &self.console).await);
                    }
                    return Err(Error::Invalid(format!(
                        "the guest's channel closed while waiting for {what}; console:\n{}",
                        self.console_tail(30)
                    )));
                }
                Ok(Ok(_)) => {}
            }
            if let Some(frame) = channel::parse(&line).map_err(Error::Invalid)? {
                return Ok(frame);
            }
        }
    }
}

async fn qemu_exited(
    qemu: &mut Child,
    status: std::io::Result<std::process::ExitStatus>,
    console: &Path,
) -> Error {
    let mut stderr = String::new();
    if let Some(mut pipe) = qemu.stderr.take() {
        let _ = tokio::io::AsyncReadExt::read_to_string(&mut pipe, &mut stderr).await;
    }
    let console = std::fs::read_to_string(console).unwrap_or_default();
    let tail: Vec<&str> = console.lines().rev().take(30).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    Error::Invalid(format!(
        "qemu-system-x86_64 exited ({}): {}\nconsole:\n{}",
        status.map_or_else(|e| e.to_string(), |s| s.to_string()),
        stderr.trim(),
        tail.join("\n")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> BootSpec {
        BootSpec {
            vmlinuz: "/k/vmlinuz".into(),
            initramfs: "/w/initramfs.cpio".into(),
            disk: "/w/disk.img".into(),
            kernel_args: vec!["module.sig_enforce=1".into()],
            memory_mib: 512,
            dir: "/w".into(),
            name: "boot1".into(),
            firmware: Firmware::Bios,
        }
    }

    fn value_of<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
        args.windows(2)
            .filter(|w| w[0] == flag)
            .map(|w| w[1].as_str())
            .collect()
    }

    #[test]
    fn the_command_line_wires_console_channel_network_and_disk() {
        let args = qemu_args(
            &spec(),
            Accelerator::Kvm,
            Path::new("/w/c.log"),
            Path::new("/w/s.sock"),
        );
        assert_eq!(value_of(&args, "-accel"), ["kvm"]);
        assert_eq!(value_of(&args, "-cpu"), ["host"]);
        assert_eq!(value_of(&args, "-m"), ["512M"]);
        assert_eq!(
            value_of(&args, "-append"),
            ["console=ttyS0 panic=-1 module.sig_enforce=1"]
        );
        // ttyS0 is the console file, ttyS1 the channel: the order of -serial matters.
        assert_eq!(
            value_of(&args, "-serial"),
            ["file:/w/c.log", "chardev:channel"]
        );
        assert_eq!(
            value_of(&args, "-chardev"),
            ["socket,id=channel,path=/w/s.sock,server=off"]
        );
        assert_eq!(
            value_of(&args, "-drive"),
            ["file=/w/disk.img,format=raw,if=virtio"]
        );
        assert!(args.contains(&"-no-reboot".to_string()));
        assert!(
            value_of(&args, "-machine").is_empty(),
            "SeaBIOS boots the default PC"
        );
    }

    #[test]
    fn uefi_maps_ovmf_code_read_only_and_the_guests_own_variables() {
        let spec = BootSpec {
            firmware: Firmware::Uefi {
                code: "/ovmf/CODE.fd".into(),
                vars: "/w/boot3.vars.fd".into(),
            },
            ..spec()
        };
        let args = qemu_args(&spec, Accelerator::Tcg, Path::new("c"), Path::new("s"));
        assert_eq!(value_of(&args, "-machine"), ["q35"]);
        // The code before the variables: pflash units are numbered in this order.
        assert_eq!(
            value_of(&args, "-drive"),
            [
                "file=/w/disk.img,format=raw,if=virtio",
                "if=pflash,format=raw,readonly=on,file=/ovmf/CODE.fd",
                "if=pflash,format=raw,file=/w/boot3.vars.fd",
            ]
        );
        assert_eq!(value_of(&args, "-kernel"), ["/k/vmlinuz"]);
    }

    #[test]
    fn software_emulation_without_kvm() {
        let args = qemu_args(&spec(), Accelerator::Tcg, Path::new("c"), Path::new("s"));
        assert_eq!(value_of(&args, "-accel"), ["tcg"]);
        assert_eq!(value_of(&args, "-cpu"), ["max"]);
    }
}
