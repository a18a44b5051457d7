//! The `newc` cpio format the kernel unpacks as its initramfs (see the kernel's
//! `Documentation/driver-api/early-userspace/buffer-format.rst`). Written here rather
//! than by the `cpio` program so the guest needs nothing that the machine lacks.

use std::collections::BTreeSet;

const MAGIC: &str = "070701";
const TRAILER: &str = "TRAILER!!!";

const S_IFDIR: u32 = 0o040_000;
const S_IFREG: u32 = 0o100_000;
const S_IFLNK: u32 = 0o120_000;
const S_IFCHR: u32 = 0o020_000;

/// An archive built in memory. Parent directories are added on demand, once each, so
/// callers name only what they care about. Paths are relative to the guest's `/`.
#[derive(Debug, Default)]
pub struct Archive {
    bytes: Vec<u8>,
    dirs: BTreeSet<String>,
    next_ino: u32,
}

impl Archive {
    pub fn dir(&mut self, path: &str) {
        let path = normalise(path);
        if path.is_empty() || self.dirs.contains(&path) {
            return;
        }
        self.parents(&path);
        self.dirs.insert(path.clone());
        self.entry(&path, S_IFDIR | 0o755, (0, 0), &[]);
    }

    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) {
        let path = normalise(path);
        self.parents(&path);
        self.entry(&path, S_IFREG | (mode & 0o7777), (0, 0), data);
    }

    pub fn symlink(&mut self, path: &str, target: &str) {
        let path = normalise(path);
        self.parents(&path);
        self.entry(&path, S_IFLNK | 0o777, (0, 0), target.as_bytes());
    }

    pub fn char_device(&mut self, path: &str, mode: u32, major: u32, minor: u32) {
        let path = normalise(path);
        self.parents(&path);
        self.entry(&path, S_IFCHR | (mode & 0o7777), (major, minor), &[]);
    }

    /// The archive with its trailer.
    pub fn finish(mut self) -> Vec<u8> {
        self.header(TRAILER, 0, 0, 0, 1, (0, 0));
        self.bytes
    }

    fn parents(&mut self, path: &str) {
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent);
        }
    }

    fn entry(&mut self, path: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        self.next_ino += 1;
        let nlink = if mode & S_IFDIR == S_IFDIR { 2 } else { 1 };
        let size = u32::try_from(data.len()).expect("initramfs entries are below 4 GiB");
        self.header(path, self.next_ino, mode, size, nlink, rdev);
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn header(&mut self, name: &str, ino: u32, mode: u32, size: u32, nlink: u32, rdev: (u32, u32)) {
        let name_size = name.len() + 1;
        let fields = [
            ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime: fixed, so equal inputs give equal archives
            size,
            0, // devmajor
            0, // devminor
            rdev.0,
            rdev.1,
            u32::try_from(name_size).expect("short path"),
            0, // check
        ];
        self.bytes.extend_from_slice(MAGIC.as_bytes());
        for field in fields {
            self.bytes
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
    }

    fn pad(&mut self) {
        let pad = padding(self.bytes.len());
        self.bytes.resize(self.bytes.len() + pad, 0);
    }
}

fn padding(len: usize) -> usize {
    (4 - len % 4) % 4
}

fn normalise(path: &str) -> String {
    path.trim_matches('/').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One parsed entry: name, mode, rdev major/minor, data.
    type Parsed = (String, u32, (u32, u32), Vec<u8>);

    fn parse(bytes: &[u8]) -> Vec<Parsed> {
        let mut entries = vec![];
        let mut at = 0;
        loop {
            assert_eq!(&bytes[at..at + 6], MAGIC.as_bytes(), "magic at {at}");
            let field = |n: usize| {
                let s = std::str::from_utf8(&bytes[at + 6 + n * 8..at + 14 + n * 8]).unwrap();
                u32::from_str_radix(s, 16).unwrap()
            };
            let (mode, size, name_size) = (field(1), field(6) as usize, field(11) as usize);
            let rdev = (field(9), field(10));
            let name_at = at + 110;
            let name = std::str::from_utf8(&bytes[name_at..name_at + name_size - 1]).unwrap();
            assert_eq!(bytes[name_at + name_size - 1], 0, "NUL after {name}");
            let data_at = name_at + name_size + padding(name_at + name_size);
            assert_eq!(data_at % 4, 0);
            let data = bytes[data_at..data_at + size].to_vec();
            at = data_at + size + padding(data_at + size);
            if name == TRAILER {
                assert_eq!(at, bytes.len(), "nothing after the trailer");
                return entries;
            }
            entries.push((name.to_string(), mode, rdev, data));
        }
    }

    #[test]
    fn entries_round_trip_with_their_parents_once() {
        let mut archive = Archive::default();
        archive.file("/bin/busybox", 0o755, b"\x7fELF...");
        archive.symlink("bin/sh", "busybox");
        archive.dir("/bin/");
        archive.file("lib/modules/6.1/modules.dep", 0o644, b"a.ko:\n");
        archive.char_device("dev/console", 0o600, 5, 1);
        let entries = parse(&archive.finish());
        let names: Vec<_> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "bin",
                "bin/busybox",
                "bin/sh",
                "lib",
                "lib/modules",
                "lib/modules/6.1",
                "lib/modules/6.1/modules.dep",
                "dev",
                "dev/console"
            ]
        );
        assert_eq!(entries[0].1, S_IFDIR | 0o755);
        assert_eq!(entries[1].1, S_IFREG | 0o755);
        assert_eq!(entries[1].3, b"\x7fELF...");
        assert_eq!(entries[2].1, S_IFLNK | 0o777);
        assert_eq!(entries[2].3, b"busybox");
        assert_eq!(entries[6].3, b"a.ko:\n");
        assert_eq!(entries[8].1, S_IFCHR | 0o600);
        assert_eq!(entries[8].2, (5, 1));
    }

    #[test]
    fn every_name_and_data_length_keeps_four_byte_alignment() {
        for len in 0..9 {
            let mut archive = Archive::default();
            let name = "n".repeat(len + 1);
            archive.file(&name, 0o644, &vec![7; len]);
            archive.file("after", 0o644, b"x");
            let entries = parse(&archive.finish());
            assert_eq!(entries[0].3.len(), len);
            assert_eq!(entries[1].0, "after");
        }
    }

    #[test]
    fn an_empty_archive_is_just_the_trailer() {
        assert!(parse(&Archive::default().finish()).is_empty());
    }
}
