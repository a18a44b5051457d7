//! Layer extraction on arbitrary input (raw layer bytes, or structured archives with
//! hostile names and links): never a panic, nothing written outside the root, and on
//! success every path inside the root resolves inside it.

#![no_main]

use std::collections::BTreeSet;
use std::fs;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use arbitrary::{Arbitrary, Unstructured};
use kmm_extract::{Compression, Layer, Limits, Selection, extract_image};
use libfuzzer_sys::fuzz_target;

const KERNEL: &str = "6.1.0-56-amd64";
const COMPONENTS: &[&str] = &[
    "opt",
    "lib",
    "modules",
    KERNEL,
    "firmware",
    "..",
    ".",
    "a.ko",
    "outside",
    ".wh.a.ko",
    ".wh..wh..opq",
    "",
];

#[derive(Debug, Arbitrary)]
enum Kind {
    File(u8),
    Dir,
    Symlink(Name),
    HardLink(Name),
    Fifo,
}

#[derive(Debug, Arbitrary)]
struct Name {
    absolute: bool,
    parts: Vec<u8>,
}

impl Name {
    fn render(&self) -> String {
        let parts: Vec<&str> = self
            .parts
            .iter()
            .take(8)
            .map(|p| COMPONENTS[*p as usize % COMPONENTS.len()])
            .collect();
        let joined = parts.join("/");
        if self.absolute {
            format!("/{joined}")
        } else {
            joined
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Entry {
    name: Name,
    kind: Kind,
}

fn header(name: &str, kind: tar::EntryType, size: u64, link: &str) -> Option<tar::Header> {
    let mut header = tar::Header::new_gnu();
    let old = header.as_old_mut();
    if name.len() > old.name.len() || link.len() > old.linkname.len() {
        return None;
    }
    old.name[..name.len()].copy_from_slice(name.as_bytes());
    old.linkname[..link.len()].copy_from_slice(link.as_bytes());
    header.set_entry_type(kind);
    header.set_size(size);
    header.set_mode(0o644);
    header.set_cksum();
    Some(header)
}

fn structured(layers: &[Vec<Entry>]) -> Vec<Vec<u8>> {
    layers
        .iter()
        .map(|entries| {
            let mut builder = tar::Builder::new(Vec::new());
            for entry in entries {
                let name = entry.name.render();
                let (kind, size, link) = match &entry.kind {
                    Kind::File(size) => (tar::EntryType::Regular, u64::from(*size), String::new()),
                    Kind::Dir => (tar::EntryType::Directory, 0, String::new()),
                    Kind::Symlink(t) => (tar::EntryType::Symlink, 0, t.render()),
                    Kind::HardLink(t) => (tar::EntryType::Link, 0, t.render()),
                    Kind::Fifo => (tar::EntryType::Fifo, 0, String::new()),
                };
                if let Some(header) = header(&name, kind, size, &link) {
                    let data = vec![b'x'; size as usize];
                    builder.append(&header, &data[..]).expect("in-memory tar");
                }
            }
            builder.into_inner().expect("in-memory tar")
        })
        .collect()
}

fn walk(dir: &Path, out: &mut BTreeSet<PathBuf>) {
    for entry in fs::read_dir(dir).expect("readable") {
        let path = entry.expect("readable").path();
        out.insert(path.clone());
        if fs::symlink_metadata(&path).expect("exists").is_dir() {
            walk(&path, out);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let layers: Vec<(Compression, Vec<u8>)> = if mode % 2 == 0 {
        let mut u = Unstructured::new(rest);
        let Ok(layers) = Vec::<Vec<Entry>>::arbitrary(&mut u) else {
            return;
        };
        structured(&layers)
            .into_iter()
            .map(|l| (Compression::None, l))
            .collect()
    } else {
        let compression = match mode % 6 {
            1 => Compression::None,
            3 => Compression::Gzip,
            _ => Compression::Zstd,
        };
        vec![(compression, rest.to_vec())]
    };

    let sandbox = tempfile::tempdir().expect("temp dir");
    fs::create_dir(sandbox.path().join("outside")).expect("outside");
    // The host's module tree for the kernel: the in-tree dependency link may reach it,
    // and nothing may be written in it.
    let host_modules = sandbox.path().join("host");
    fs::create_dir_all(host_modules.join(KERNEL)).expect("host module tree");
    let root = sandbox.path().join("root");
    let selection = Selection {
        dir_name: "/opt".into(),
        kernel: KERNEL.into(),
        firmware_path: Some("/firmware".into()),
        host_modules: Some(host_modules.clone()),
    };
    let limits = Limits {
        max_file_bytes: 200,
        max_image_bytes: 1000,
        max_entries: 64,
        max_layer_read_bytes: 1 << 20,
    };
    let result = extract_image(
        layers.into_iter().map(|(compression, data)| Layer {
            compression,
            reader: Cursor::new(data),
        }),
        &selection,
        &limits,
        &root,
    );

    let mut everything = BTreeSet::new();
    walk(sandbox.path(), &mut everything);
    let outside: Vec<_> = everything
        .iter()
        .filter(|p| !p.starts_with(&root))
        .collect();
    assert_eq!(
        outside,
        vec![
            &host_modules,
            &host_modules.join(KERNEL),
            &sandbox.path().join("outside")
        ],
        "written outside the root"
    );
    assert!(
        fs::read_dir(sandbox.path().join("outside"))
            .expect("outside")
            .next()
            .is_none(),
        "written outside the root"
    );
    match result {
        Ok(report) => {
            assert!(report.bytes <= limits.max_image_bytes);
            let real_root = root.canonicalize().expect("root exists");
            let host_tree = host_modules.join(KERNEL).canonicalize().expect("host tree");
            for path in everything.iter().filter(|p| p.starts_with(&root)) {
                if let Ok(real) = path.canonicalize() {
                    assert!(
                        real.starts_with(&real_root) || real == host_tree,
                        "{} escapes",
                        path.display()
                    );
                }
            }
        }
        Err(_) => assert!(!root.exists(), "partial extraction left behind"),
    }
});
