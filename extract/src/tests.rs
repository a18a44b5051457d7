use std::collections::BTreeSet;
use std::io::Write;

use proptest::prelude::*;

use super::*;

const K: &str = "6.1.0-56-amd64";

/// An entry of a test archive; names are written as raw bytes, hostile ones included.
#[derive(Clone, Debug)]
enum E {
    Dir(&'static str),
    File(String, Vec<u8>),
    Symlink(String, String),
    HardLink(String, String),
    Fifo(&'static str),
}

fn file(path: &str, data: &[u8]) -> E {
    E::File(path.to_string(), data.to_vec())
}

fn raw_header(name: &str, kind: tar::EntryType, size: u64) -> tar::Header {
    let mut header = tar::Header::new_gnu();
    let bytes = name.as_bytes();
    header.as_old_mut().name[..bytes.len()].copy_from_slice(bytes);
    header.set_entry_type(kind);
    header.set_size(size);
    header.set_mode(0o644);
    header
}

fn with_link(mut header: tar::Header, target: &str) -> tar::Header {
    let bytes = target.as_bytes();
    header.as_old_mut().linkname[..bytes.len()].copy_from_slice(bytes);
    header
}

fn tar(entries: &[E]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let (mut header, data): (tar::Header, &[u8]) = match entry {
            E::Dir(p) => (raw_header(p, tar::EntryType::Directory, 0), &[]),
            E::File(p, d) => (raw_header(p, tar::EntryType::Regular, d.len() as u64), d),
            E::Symlink(p, t) => (with_link(raw_header(p, tar::EntryType::Symlink, 0), t), &[]),
            E::HardLink(p, t) => (with_link(raw_header(p, tar::EntryType::Link, 0), t), &[]),
            E::Fifo(p) => (raw_header(p, tar::EntryType::Fifo, 0), &[]),
        };
        header.set_cksum();
        builder.append(&header, data).unwrap();
    }
    builder.into_inner().unwrap()
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(data).unwrap();
    encoder.finish().unwrap()
}

/// A sandbox: `<tmp>/root` is the extraction root; everything else in `<tmp>` is
/// "outside" and must never change.
struct Sandbox {
    dir: tempfile::TempDir,
}

impl Sandbox {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("outside")).unwrap();
        fs::write(dir.path().join("outside/victim"), b"original").unwrap();
        // The host's module tree, as the agent sees it mounted: outside the root too.
        let in_tree = dir.path().join(format!("host/lib/modules/{K}/kernel"));
        fs::create_dir_all(&in_tree).unwrap();
        fs::write(in_tree.join("in_tree.ko"), b"in-tree").unwrap();
        Self { dir }
    }
    fn host_modules(&self) -> PathBuf {
        self.dir.path().join("host/lib/modules")
    }
    fn selection(&self) -> Selection {
        Selection {
            dir_name: "/opt".into(),
            kernel: K.into(),
            firmware_path: Some("/firmware".into()),
            host_modules: Some(self.host_modules()),
        }
    }
    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }
    fn outside(&self) -> PathBuf {
        self.dir.path().join("outside")
    }
    fn extract(&self, layers: Vec<(Compression, Vec<u8>)>) -> Result<Report, ExtractError> {
        self.extract_with(layers, &Limits::default())
    }
    fn extract_with(
        &self,
        layers: Vec<(Compression, Vec<u8>)>,
        limits: &Limits,
    ) -> Result<Report, ExtractError> {
        let layers = layers.into_iter().map(|(compression, data)| Layer {
            compression,
            reader: io::Cursor::new(data),
        });
        extract_image(layers, &self.selection(), limits, &self.root())
    }
    /// Every path in the sandbox outside the root, and the victim's content.
    fn outside_state(&self) -> (BTreeSet<PathBuf>, Vec<u8>) {
        let mut paths = BTreeSet::new();
        walk(self.dir.path(), &mut paths);
        let root = self.root();
        paths.retain(|p| !p.starts_with(&root));
        (paths, fs::read(self.outside().join("victim")).unwrap())
    }
    fn assert_refused_cleanly(&self, before: &(BTreeSet<PathBuf>, Vec<u8>)) {
        assert_eq!(
            &self.outside_state(),
            before,
            "something was written outside the root"
        );
        assert!(
            !self.root().exists(),
            "the partial extraction was not removed"
        );
    }
}

fn walk(dir: &Path, out: &mut BTreeSet<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        out.insert(path.clone());
        if fs::symlink_metadata(&path).unwrap().is_dir() {
            walk(&path, out);
        }
    }
}

fn m(rest: &str) -> String {
    format!("opt/lib/modules/{K}/{rest}")
}

fn refused(entries: &[E]) -> (Sandbox, ExtractError) {
    let sandbox = Sandbox::new();
    let before = sandbox.outside_state();
    let err = sandbox
        .extract(vec![(Compression::None, tar(entries))])
        .expect_err("hostile image was accepted");
    sandbox.assert_refused_cleanly(&before);
    (sandbox, err)
}

#[test]
fn extracts_only_modules_and_firmware() {
    let sandbox = Sandbox::new();
    let layer = tar(&[
        E::Dir("bin/"),
        file("bin/sh", b"shell"),
        E::Dir("opt/"),
        file("opt/other.txt", b"no"),
        file(&m("extra/a.ko"), b"module a"),
        file(&m("modules.dep"), b"extra/a.ko:\n"),
        file("opt/lib/modules/5.0.0/extra/old.ko", b"other kernel"),
        file("firmware/fw.bin", b"firmware"),
        file("etc/passwd", b"root::0:0"),
    ]);
    let report = sandbox
        .extract(vec![(Compression::Gzip, gzip(&layer))])
        .unwrap();
    assert_eq!(report.files, 3);
    assert_eq!(report.skipped, 6);
    let root = sandbox.root();
    assert_eq!(fs::read(root.join(m("extra/a.ko"))).unwrap(), b"module a");
    assert_eq!(fs::read(root.join("firmware/fw.bin")).unwrap(), b"firmware");
    assert!(!root.join("bin").exists());
    assert!(!root.join("etc").exists());
    assert!(!root.join("opt/other.txt").exists());
    assert!(!root.join("opt/lib/modules/5.0.0").exists());
}

#[test]
fn zstd_and_plain_layers() {
    let sandbox = Sandbox::new();
    let one = tar(&[file(&m("a.ko"), b"a")]);
    let two = zstd::encode_all(&tar(&[file(&m("b.ko"), b"b")])[..], 3).unwrap();
    sandbox
        .extract(vec![(Compression::None, one), (Compression::Zstd, two)])
        .unwrap();
    assert_eq!(fs::read(sandbox.root().join(m("a.ko"))).unwrap(), b"a");
    assert_eq!(fs::read(sandbox.root().join(m("b.ko"))).unwrap(), b"b");
}

#[test]
fn absolute_path_is_refused() {
    let sandbox = Sandbox::new();
    let victim = format!("{}/victim", sandbox.outside().display());
    let (_, err) = refused(&[file(&m("a.ko"), b"a"), file(&victim, b"pwned")]);
    assert!(matches!(err, ExtractError::AbsolutePath { .. }), "{err}");
    assert!(err.to_string().contains("absolute path"), "{err}");
    let (_, err) = refused(&[file("/opt/lib/modules/x.ko", b"x")]);
    assert!(matches!(err, ExtractError::AbsolutePath { .. }), "{err}");
}

#[test]
fn parent_traversal_is_refused() {
    for path in [
        "../outside/victim".to_string(),
        m("../../../../../outside/victim"),
        format!("{}/../{K}/a.ko", "opt/lib/modules"),
    ] {
        let (_, err) = refused(&[file(&path, b"pwned")]);
        assert!(
            matches!(err, ExtractError::ParentTraversal { .. }),
            "{path}: {err}"
        );
        assert!(err.to_string().contains("`..`"), "{err}");
    }
}

#[test]
fn symlink_escapes_are_refused() {
    let depth = "../".repeat(8);
    let cases = [
        vec![E::Symlink(m("evil"), format!("{depth}outside"))],
        vec![E::Symlink(m("evil"), "/etc".into())],
        vec![
            E::Symlink(m("evil"), "/etc".into()),
            file(&m("evil/passwd"), b"pwned"),
        ],
        // A link that is fine by itself, then one that climbs through it.
        vec![
            E::Symlink(m("up"), "..".into()),
            E::Symlink(m("evil"), "up/../../../../../outside".into()),
        ],
        // A link to an unextracted place inside the image.
        vec![E::Symlink(m("bin"), "/bin".into())],
        vec![E::Symlink(m("loop"), "loop".into())],
    ];
    for entries in cases {
        let (_, err) = refused(&entries);
        assert!(
            matches!(
                err,
                ExtractError::SymlinkEscape { .. }
                    | ExtractError::PathEscape { .. }
                    | ExtractError::LinkLoop { .. }
            ),
            "{entries:?}: {err}"
        );
    }
}

#[test]
fn file_through_an_ancestor_link_is_not_followed_outside() {
    // `opt` as a link is outside the allowed directories, so it is skipped; the module
    // is then written under a real `opt/` inside the root.
    let sandbox = Sandbox::new();
    let outside = sandbox.outside().display().to_string();
    let before = sandbox.outside_state();
    sandbox
        .extract(vec![(
            Compression::None,
            tar(&[E::Symlink("opt".into(), outside), file(&m("a.ko"), b"a")]),
        )])
        .unwrap();
    assert_eq!(sandbox.outside_state(), before);
    let opt = fs::symlink_metadata(sandbox.root().join("opt")).unwrap();
    assert!(opt.is_dir());
}

#[test]
fn internal_links_are_kept_relative() {
    let sandbox = Sandbox::new();
    sandbox
        .extract(vec![(
            Compression::None,
            tar(&[
                file(&m("extra/real.ko"), b"real"),
                E::Symlink(m("extra/rel.ko"), "real.ko".into()),
                E::Symlink(m("abs.ko"), format!("/{}", m("extra/real.ko"))),
                E::Symlink(m("dir"), "extra".into()),
                file(&m("dir/through.ko"), b"through"),
                E::HardLink(m("hard.ko"), m("extra/real.ko")),
            ]),
        )])
        .unwrap();
    let root = sandbox.root();
    for link in ["extra/rel.ko", "abs.ko", "hard.ko"] {
        assert_eq!(fs::read(root.join(m(link))).unwrap(), b"real", "{link}");
    }
    let target = fs::read_link(root.join(m("abs.ko"))).unwrap();
    assert!(target.is_relative(), "{}", target.display());
    assert_eq!(
        fs::read(root.join(m("extra/through.ko"))).unwrap(),
        b"through"
    );
}

#[test]
fn hard_link_escapes_are_refused() {
    let cases = [
        vec![E::HardLink(m("passwd"), "/etc/passwd".into())],
        vec![E::HardLink(m("passwd"), "../../etc/passwd".into())],
        vec![
            file("etc/passwd", b"x"),
            E::HardLink(m("passwd"), "etc/passwd".into()),
        ],
        vec![E::HardLink(m("missing"), m("nothing.ko"))],
        vec![
            E::Symlink(m("dir"), "extra".into()),
            E::HardLink(m("dirlink"), m("dir")),
        ],
    ];
    for entries in cases {
        let (_, err) = refused(&entries);
        assert!(
            matches!(err, ExtractError::HardLinkEscape { .. }),
            "{entries:?}: {err}"
        );
        assert!(err.to_string().contains("hard link"), "{err}");
    }
}

#[test]
fn size_limits() {
    let limits = Limits {
        max_file_bytes: 10,
        max_image_bytes: 15,
        max_entries: 5,
        max_layer_read_bytes: 64 << 10,
    };
    let sandbox = Sandbox::new();
    let before = sandbox.outside_state();
    let err = sandbox
        .extract_with(
            vec![(Compression::None, tar(&[file(&m("big.ko"), &[0; 11])]))],
            &limits,
        )
        .unwrap_err();
    assert!(
        matches!(err, ExtractError::FileTooLarge { size: 11, .. }),
        "{err}"
    );
    sandbox.assert_refused_cleanly(&before);

    let err = sandbox
        .extract_with(
            vec![(
                Compression::None,
                tar(&[file(&m("a.ko"), &[0; 10]), file(&m("b.ko"), &[0; 10])]),
            )],
            &limits,
        )
        .unwrap_err();
    assert!(matches!(err, ExtractError::ImageTooLarge { .. }), "{err}");
    sandbox.assert_refused_cleanly(&before);

    let many: Vec<E> = (0..6).map(|i| file(&m(&format!("{i}.ko")), b"")).collect();
    let err = sandbox
        .extract_with(vec![(Compression::None, tar(&many))], &limits)
        .unwrap_err();
    assert!(matches!(err, ExtractError::TooManyEntries { .. }), "{err}");
    sandbox.assert_refused_cleanly(&before);

    // A layer that decompresses to more than the read limit, even if skipped.
    let bomb: Vec<E> = vec![file("usr/zeros", &vec![0; 128 << 10])];
    let err = sandbox
        .extract_with(vec![(Compression::Gzip, gzip(&tar(&bomb)))], &limits)
        .unwrap_err();
    assert!(matches!(err, ExtractError::LayerTooLarge { .. }), "{err}");
    sandbox.assert_refused_cleanly(&before);

    // Skipped entries do not count.
    let mut skipped: Vec<E> = (0..20)
        .map(|i| file(&format!("usr/{i}"), &[0; 100]))
        .collect();
    skipped.push(file(&m("a.ko"), &[1; 10]));
    sandbox
        .extract_with(vec![(Compression::None, tar(&skipped))], &limits)
        .unwrap();
}

#[test]
fn corrupt_layers_are_refused() {
    let good = gzip(&tar(&[file(&m("a.ko"), &[7; 4096])]));
    let mut flipped = good.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0xff;
    let truncated = good[..good.len() / 2].to_vec();
    let mut bad_tar = tar(&[file(&m("a.ko"), b"a")]);
    bad_tar[148] ^= 0x01; // header checksum
    let cases = [
        (Compression::Gzip, flipped),
        (Compression::Gzip, truncated),
        (Compression::Gzip, b"not gzip at all".to_vec()),
        (Compression::Zstd, b"not zstd at all".to_vec()),
        (Compression::None, bad_tar),
    ];
    for (compression, data) in cases {
        let sandbox = Sandbox::new();
        let before = sandbox.outside_state();
        let err = sandbox.extract(vec![(compression, data)]).unwrap_err();
        assert!(
            matches!(err, ExtractError::Corrupt { .. }),
            "{compression:?}: {err}"
        );
        assert!(err.to_string().contains("corrupt"), "{err}");
        sandbox.assert_refused_cleanly(&before);
    }
}

#[test]
fn devices_and_fifos_are_refused() {
    let (_, err) = refused(&[E::Fifo("opt/lib/modules/6.1.0-56-amd64/fifo")]);
    assert!(
        matches!(err, ExtractError::UnsupportedEntry { .. }),
        "{err}"
    );
    // Outside the allowed directories they are simply skipped.
    let sandbox = Sandbox::new();
    sandbox
        .extract(vec![(Compression::None, tar(&[E::Fifo("dev/fifo")]))])
        .unwrap();
}

#[test]
fn whiteouts_remove_lower_layers() {
    let sandbox = Sandbox::new();
    let lower = tar(&[
        file(&m("extra/a.ko"), b"a"),
        file(&m("extra/b.ko"), b"b"),
        file(&m("old/c.ko"), b"c"),
        file("firmware/x.bin", b"x"),
    ]);
    let upper = tar(&[
        file(&m("extra/.wh.a.ko"), b""),
        file(&m("old/.wh..wh..opq"), b""),
        file(&m("old/d.ko"), b"d"),
        file("firmware/.wh.x.bin", b""),
        // A whiteout of something outside the root is harmless and ignored.
        file("etc/.wh.passwd", b""),
    ]);
    sandbox
        .extract(vec![(Compression::None, lower), (Compression::None, upper)])
        .unwrap();
    let root = sandbox.root();
    assert!(!root.join(m("extra/a.ko")).exists());
    assert!(root.join(m("extra/b.ko")).exists());
    assert!(!root.join(m("old/c.ko")).exists());
    assert!(root.join(m("old/d.ko")).exists());
    assert!(!root.join("firmware/x.bin").exists());
    assert!(!root.join(m("extra/.wh.a.ko")).exists());
}

#[test]
fn later_layers_replace_files_and_links() {
    let sandbox = Sandbox::new();
    let lower = tar(&[
        file(&m("a.ko"), b"old"),
        E::Symlink(m("l.ko"), "a.ko".into()),
    ]);
    let upper = tar(&[file(&m("a.ko"), b"new"), file(&m("l.ko"), b"plain")]);
    sandbox
        .extract(vec![(Compression::None, lower), (Compression::None, upper)])
        .unwrap();
    assert_eq!(fs::read(sandbox.root().join(m("a.ko"))).unwrap(), b"new");
    assert!(
        fs::symlink_metadata(sandbox.root().join(m("l.ko")))
            .unwrap()
            .is_file()
    );
}

#[test]
fn set_id_bits_are_dropped() {
    let sandbox = Sandbox::new();
    let mut header = raw_header(&m("s.ko"), tar::EntryType::Regular, 1);
    header.set_mode(0o6777);
    header.set_cksum();
    let mut builder = tar::Builder::new(Vec::new());
    builder.append(&header, &b"s"[..]).unwrap();
    sandbox
        .extract(vec![(Compression::None, builder.into_inner().unwrap())])
        .unwrap();
    let mode = fs::metadata(sandbox.root().join(m("s.ko")))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o755);
}

#[test]
fn invalid_selection_is_refused() {
    for (dir_name, firmware) in [
        ("/opt/..", None),
        ("/opt", Some("/")),
        ("/opt", Some("../x")),
    ] {
        let sel = Selection {
            dir_name: dir_name.into(),
            kernel: K.into(),
            firmware_path: firmware.map(Into::into),
            host_modules: None,
        };
        let dir = tempfile::tempdir().unwrap();
        let err = extract_image(
            Vec::<Layer<&[u8]>>::new(),
            &sel,
            &Limits::default(),
            &dir.path().join("root"),
        )
        .unwrap_err();
        assert!(matches!(err, ExtractError::InvalidSelection(_)), "{err}");
    }
}

#[test]
fn media_types() {
    assert_eq!(
        Compression::from_media_type("application/vnd.oci.image.layer.v1.tar+zstd").unwrap(),
        Compression::Zstd
    );
    assert_eq!(
        Compression::from_media_type("application/vnd.docker.image.rootfs.diff.tar.gzip").unwrap(),
        Compression::Gzip
    );
    assert!(Compression::from_media_type("application/json").is_err());
}

#[test]
fn the_in_tree_dependency_link_points_at_the_host_module_tree() {
    for target in [format!("/lib/modules/{K}"), format!("/usr/lib/modules/{K}")] {
        let sandbox = Sandbox::new();
        let before = sandbox.outside_state();
        sandbox
            .extract(vec![(
                Compression::None,
                tar(&[
                    file(&m("extra/oot.ko"), b"oot"),
                    E::Symlink(m("host"), target.clone()),
                ]),
            )])
            .unwrap();
        let link = sandbox.root().join(m("host"));
        assert_eq!(
            fs::read_link(&link).unwrap(),
            sandbox.host_modules().join(K)
        );
        // modprobe -d follows it to the host's in-tree modules.
        assert_eq!(
            fs::read(link.join("kernel/in_tree.ko")).unwrap(),
            b"in-tree"
        );
        assert_eq!(sandbox.outside_state(), before, "{target}");
    }
}

#[test]
fn the_in_tree_dependency_link_opens_no_escape() {
    let cases = [
        // Anything written, linked or hard-linked through it.
        vec![
            E::Symlink(m("host"), format!("/lib/modules/{K}")),
            file(&m("host/kernel/in_tree.ko"), b"pwned"),
        ],
        vec![
            E::Symlink(m("host"), format!("/lib/modules/{K}")),
            file(&m("host/new.ko"), b"pwned"),
        ],
        vec![
            E::Symlink(m("host"), format!("/lib/modules/{K}")),
            E::Symlink(m("via"), "host/kernel".into()),
        ],
        vec![
            E::Symlink(m("host"), format!("/lib/modules/{K}")),
            E::HardLink(m("copy.ko"), m("host/kernel/in_tree.ko")),
        ],
        // Another kernel's tree, the tree's root, a deeper place, a climb.
        vec![E::Symlink(m("host"), "/lib/modules/5.14.0-1-other".into())],
        vec![E::Symlink(m("host"), "/lib/modules".into())],
        vec![E::Symlink(m("host"), format!("/lib/modules/{K}/kernel"))],
        vec![E::Symlink(
            m("host"),
            format!("/lib/modules/{K}/../../../etc"),
        )],
        vec![E::Symlink(m("host"), format!("/lib/../etc/modules/{K}"))],
        // Relative, or placed anywhere but directly in the kernel's module directory.
        vec![E::Symlink(
            m("host"),
            format!("../../../../lib/modules/{K}"),
        )],
        vec![E::Symlink(m("extra/host"), format!("/lib/modules/{K}"))],
        vec![E::Symlink(
            "firmware/host".into(),
            format!("/lib/modules/{K}"),
        )],
    ];
    for entries in cases {
        let (_, err) = refused(&entries);
        assert!(
            matches!(
                err,
                ExtractError::SymlinkEscape { .. }
                    | ExtractError::PathEscape { .. }
                    | ExtractError::HardLinkEscape { .. }
            ),
            "{entries:?}: {err}"
        );
    }
}

#[test]
fn without_a_host_module_tree_the_link_is_refused() {
    let sandbox = Sandbox::new();
    let mut selection = sandbox.selection();
    selection.host_modules = None;
    let layer = Layer {
        compression: Compression::None,
        reader: io::Cursor::new(tar(&[E::Symlink(m("host"), format!("/lib/modules/{K}"))])),
    };
    let err = extract_image([layer], &selection, &Limits::default(), &sandbox.root())
        .expect_err("the link is refused");
    assert!(matches!(err, ExtractError::SymlinkEscape { .. }), "{err}");
}

fn arb_path() -> impl Strategy<Value = String> {
    let component = prop_oneof![
        Just("opt".to_string()),
        Just("lib".to_string()),
        Just("modules".to_string()),
        Just(K.to_string()),
        Just("firmware".to_string()),
        Just("..".to_string()),
        Just(".".to_string()),
        Just("a".to_string()),
        Just("outside".to_string()),
        Just(".wh.a".to_string()),
    ];
    (any::<bool>(), prop::collection::vec(component, 1..7)).prop_map(|(abs, parts)| {
        let joined = parts.join("/");
        if abs { format!("/{joined}") } else { joined }
    })
}

fn arb_entry() -> impl Strategy<Value = E> {
    prop_oneof![
        arb_path().prop_map(|p| E::File(p, b"data".to_vec())),
        (arb_path(), arb_path()).prop_map(|(p, t)| E::Symlink(p, t)),
        (arb_path(), arb_path()).prop_map(|(p, t)| E::HardLink(p, t)),
        // Well-formed entries under the allowed directory, so that deep cases happen.
        "[a-c]{1}".prop_map(|n| file(&m(&n), b"ok")),
        ("[a-c]{1}", arb_path()).prop_map(|(n, t)| E::Symlink(m(&n), t)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever the entries, nothing outside the root changes, and every link left
    /// inside the root resolves inside it.
    #[test]
    fn never_writes_outside(layers in prop::collection::vec(prop::collection::vec(arb_entry(), 0..8), 1..3)) {
        let sandbox = Sandbox::new();
        let before = sandbox.outside_state();
        let data = layers.iter().map(|l| (Compression::None, tar(l))).collect();
        let result = sandbox.extract(data);
        prop_assert_eq!(sandbox.outside_state(), before);
        if result.is_ok() {
            let root = sandbox.root().canonicalize().unwrap();
            let host_tree = sandbox.host_modules().join(K).canonicalize().unwrap();
            let mut inside = BTreeSet::new();
            walk(&root, &mut inside);
            for path in inside {
                if let Ok(real) = path.canonicalize() {
                    prop_assert!(
                        real.starts_with(&root) || real == host_tree,
                        "{} -> {}", path.display(), real.display()
                    );
                }
            }
        } else {
            prop_assert!(!sandbox.root().exists());
        }
    }
}
