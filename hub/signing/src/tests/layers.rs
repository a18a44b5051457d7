use std::io::{Cursor, Read, Write};

use kmm_extract::{Compression, Layer};

use super::shared;
use super::support::elf_module;
use crate::{
    HashAlgorithm, LAYER_MEDIA_TYPE, Limits, SignError, SignedLayer, sign_files_in_layers,
    sign_module,
};

const KO: &str = "/opt/lib/modules/6.1.0-47-amd64/extra/kmm_hello.ko";
const DEP_KO: &str = "/opt/lib/modules/6.1.0-47-amd64/extra/kmm_hello_dep.ko";

/// One entry of a test layer; paths as a layer has them (relative).
enum Entry<'a> {
    Dir(&'a str),
    File(&'a str, &'a [u8], u32),
    Symlink(&'a str, &'a str),
    HardLink(&'a str, &'a str),
    /// A name written into the header as is, which `tar::Builder` would refuse.
    Raw(&'a str),
}
use Entry::*;

fn tar(entries: &[Entry<'_>]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let mut header = tar::Header::new_gnu();
        header.set_mtime(1_700_000_000);
        match entry {
            Dir(path) => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(0o755);
                header.set_size(0);
                builder.append_data(&mut header, path, &[][..]).unwrap();
            }
            File(path, data, mode) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(*mode);
                header.set_uid(1000);
                header.set_size(data.len() as u64);
                builder.append_data(&mut header, path, *data).unwrap();
            }
            Symlink(path, target) | HardLink(path, target) => {
                header.set_entry_type(if matches!(entry, Symlink(..)) {
                    tar::EntryType::Symlink
                } else {
                    tar::EntryType::Link
                });
                header.set_mode(0o777);
                header.set_size(0);
                builder.append_link(&mut header, path, target).unwrap();
            }
            Raw(path) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(0o644);
                header.set_size(0);
                header.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
                header.set_cksum();
                builder.append(&header, &[][..]).unwrap();
            }
        }
    }
    builder.into_inner().unwrap()
}

fn gzip(entries: &[Entry<'_>]) -> Layer<Cursor<Vec<u8>>> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(&tar(entries)).unwrap();
    Layer {
        compression: Compression::Gzip,
        reader: Cursor::new(encoder.finish().unwrap()),
    }
}

fn sign(layers: Vec<Layer<Cursor<Vec<u8>>>>, files: &[&str]) -> Result<SignedLayer, SignError> {
    let (_, key) = shared();
    let files: Vec<String> = files.iter().map(|f| f.to_string()).collect();
    sign_files_in_layers(
        layers,
        &files,
        key,
        HashAlgorithm::Sha256,
        &Limits::default(),
    )
}

/// The digest of `module` signed as sign_module signs it.
fn signed(module: &[u8], name: &str) -> String {
    sha256(&sign_module(name, module, &shared().1, HashAlgorithm::Sha256).unwrap())
}

/// The signed layer's entries: path, mode, uid, gid, mtime, digest of the content
/// (short in a failure's message).
fn entries(layer: &SignedLayer) -> Vec<(String, u32, u64, u64, u64, String)> {
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(layer.blob.as_slice()));
    tar.entries()
        .unwrap()
        .map(|entry| {
            let mut entry = entry.unwrap();
            let header = entry.header().clone();
            assert_eq!(header.entry_type(), tar::EntryType::Regular);
            let mut data = Vec::new();
            entry.read_to_end(&mut data).unwrap();
            (
                entry.path().unwrap().display().to_string(),
                header.mode().unwrap(),
                header.uid().unwrap(),
                header.gid().unwrap(),
                header.mtime().unwrap(),
                sha256(&data),
            )
        })
        .collect()
}

fn sha256(data: &[u8]) -> String {
    let hex: String = openssl::sha::sha256(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

#[test]
fn signs_the_listed_files_into_one_deterministic_layer() {
    let hello = elf_module(3_000, 10);
    let dep = elf_module(2_000, 11);
    let image = || {
        vec![gzip(&[
            Dir("opt"),
            Dir("opt/lib/modules/6.1.0-47-amd64/extra"),
            File(&KO[1..], &hello, 0o644),
            File(&DEP_KO[1..], &dep, 0o600),
            File("usr/bin/tool", b"#!/bin/sh\n", 0o755),
        ])]
    };
    let layer = sign(image(), &[KO, DEP_KO]).unwrap();
    assert_eq!(layer.digest, sha256(&layer.blob));
    let mut tar = Vec::new();
    flate2::read::GzDecoder::new(layer.blob.as_slice())
        .read_to_end(&mut tar)
        .unwrap();
    assert_eq!(layer.diff_id, sha256(&tar));
    assert_eq!(
        entries(&layer),
        // Sorted by path: "kmm_hello.ko" < "kmm_hello_dep.ko".
        [
            (KO[1..].to_string(), 0o644, 0, 0, 0, signed(&hello, KO)),
            (
                DEP_KO[1..].to_string(),
                0o600,
                0,
                0,
                0,
                signed(&dep, DEP_KO)
            ),
        ]
    );
    let stored: Vec<(&str, &str)> = layer
        .files
        .iter()
        .map(|f| (f.path.as_str(), f.stored_at.as_str()))
        .collect();
    assert_eq!(stored, [(KO, KO), (DEP_KO, DEP_KO)]);

    // The same input, listed in another order and twice, gives the same bytes.
    let again = sign(image(), &[DEP_KO, KO, DEP_KO]).unwrap();
    assert_eq!(again.blob, layer.blob);
    assert_eq!(again.digest, layer.digest);
    assert_eq!(again.diff_id, layer.diff_id);
    assert_eq!(
        LAYER_MEDIA_TYPE,
        "application/vnd.oci.image.layer.v1.tar+gzip"
    );
}

#[test]
fn globs_sign_every_file_they_match_within_one_path_component() {
    let hello = elf_module(3_000, 10);
    let dep = elf_module(2_000, 11);
    let image = || {
        vec![gzip(&[
            Dir("opt/lib/modules/6.1.0-47-amd64/extra"),
            File(&KO[1..], &hello, 0o644),
            File(&DEP_KO[1..], &dep, 0o600),
            File("opt/lib/modules/6.1.0-47-amd64/modules.dep", b"x", 0o644),
        ])]
    };
    let by_glob = sign(image(), &["/opt/lib/modules/6.1.0-47-amd64/extra/*.ko"]).unwrap();
    let listed = sign(image(), &[KO, DEP_KO]).unwrap();
    assert_eq!(by_glob.blob, listed.blob, "the same files, the same layer");
    let paths: Vec<&str> = by_glob.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, [KO, DEP_KO]);

    // A literal path and a glob naming the same file sign it once.
    let both = sign(image(), &[KO, "/opt/lib/modules/*/extra/kmm_hello*.ko"]).unwrap();
    assert_eq!(both.blob, listed.blob);

    // `*` does not cross a `/`: the modules are one directory further down.
    let err = sign(image(), &["/opt/lib/modules/*.ko"]).unwrap_err();
    assert!(
        matches!(&err, SignError::NoFileMatches { pattern } if pattern == "/opt/lib/modules/*.ko"),
        "{err}"
    );
    assert!(err.is_input_fault());
    let err = sign(image(), &["/opt/[.ko"]).unwrap_err();
    assert!(matches!(err, SignError::InvalidPath { .. }), "{err}");
}

#[test]
fn a_later_layer_wins() {
    let old = elf_module(1_000, 20);
    let new = elf_module(1_500, 21);
    let layer = sign(
        vec![
            gzip(&[File(&KO[1..], &old, 0o644)]),
            gzip(&[File("other", b"x", 0o644)]),
            gzip(&[File(&KO[1..], &new, 0o640)]),
        ],
        &[KO],
    )
    .unwrap();
    let entries = entries(&layer);
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].1, 0o640);
    assert_eq!(entries[0].5, signed(&new, KO));
}

#[test]
fn whiteouts_delete_listed_files() {
    let module = elf_module(1_000, 30);
    let dir = "opt/lib/modules/6.1.0-47-amd64/extra";
    for whiteout in [
        format!("{dir}/.wh.kmm_hello.ko"),
        format!("{dir}/.wh..wh..opq"),
        "opt/lib/modules/.wh.6.1.0-47-amd64".to_string(),
        "opt/.wh..wh..opq".to_string(),
    ] {
        let err = sign(
            vec![
                gzip(&[File(&KO[1..], &module, 0o644)]),
                gzip(&[File(&whiteout, b"", 0o644)]),
            ],
            &[KO],
        )
        .unwrap_err();
        assert!(
            matches!(&err, SignError::FileNotInImage { path } if path == KO),
            "{whiteout}: {err:?}"
        );
        assert!(err.to_string().contains(KO), "{err}");
    }
    // An opaque directory keeps what its own layer puts in it, and a file deleted by
    // one layer can come back in the next.
    let layer = sign(
        vec![
            gzip(&[File(&KO[1..], b"\x7fELF old", 0o644)]),
            gzip(&[
                File(&format!("{dir}/.wh..wh..opq"), b"", 0o644),
                File(&KO[1..], &module, 0o644),
            ]),
        ],
        &[KO],
    )
    .unwrap();
    assert_eq!(entries(&layer)[0].5, signed(&module, KO));
    let layer = sign(
        vec![
            gzip(&[File(&KO[1..], b"\x7fELF old", 0o644)]),
            gzip(&[File(&format!("{dir}/.wh.kmm_hello.ko"), b"", 0o644)]),
            gzip(&[File(&KO[1..], &module, 0o644)]),
        ],
        &[KO],
    )
    .unwrap();
    assert_eq!(entries(&layer)[0].5, signed(&module, KO));
}

#[test]
fn missing_files_and_bad_paths_are_refused_by_name() {
    let module = elf_module(1_000, 40);
    let image = || vec![gzip(&[File(&KO[1..], &module, 0o644)])];
    let err = sign(image(), &[KO, DEP_KO]).unwrap_err();
    assert!(
        matches!(&err, SignError::FileNotInImage { path } if path == DEP_KO),
        "{err:?}"
    );
    assert!(err.to_string().contains(DEP_KO), "{err}");

    for bad in [
        "/opt/lib/modules/../../etc/shadow",
        "opt/lib/modules/6.1.0-47-amd64/extra/kmm_hello.ko",
        "/",
        "",
    ] {
        let err = sign(image(), &[bad]).unwrap_err();
        assert!(
            matches!(&err, SignError::InvalidPath { path, .. } if path == bad),
            "{bad:?}: {err:?}"
        );
        assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
    }
    assert!(matches!(
        sign(image(), &[]).unwrap_err(),
        SignError::NothingToSign
    ));

    // A listed directory, a hard link, a file that is no module.
    let err = sign(image(), &["/opt/lib/modules"]).unwrap_err();
    assert!(
        matches!(
            err,
            SignError::NotARegularFile {
                kind: "directory",
                ..
            }
        ),
        "{err:?}"
    );
    let err = sign(
        vec![gzip(&[
            File(&KO[1..], &module, 0o644),
            HardLink("opt/copy.ko", &KO[1..]),
        ])],
        &["/opt/copy.ko"],
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            SignError::NotARegularFile {
                kind: "hard link",
                ..
            }
        ),
        "{err:?}"
    );
    let err = sign(
        vec![gzip(&[File("opt/readme", b"text", 0o644)])],
        &["/opt/readme"],
    )
    .unwrap_err();
    assert!(
        matches!(&err, SignError::NotElf { name } if name == "/opt/readme"),
        "{err:?}"
    );
}

#[test]
fn links_resolve_inside_the_image_and_the_file_is_signed_where_it_is() {
    let module = elf_module(1_000, 50);
    let real = "/usr/lib/modules/6.1.0-47-amd64/extra/kmm_hello.ko";
    let listed = "/lib/modules/6.1.0-47-amd64/extra/kmm_hello.ko";
    for (what, layers) in [
        (
            "merged /usr, link in a lower layer",
            vec![
                gzip(&[Symlink("lib", "usr/lib"), Dir("usr/lib")]),
                gzip(&[File(&real[1..], &module, 0o644)]),
            ],
        ),
        (
            "link after the file in the same layer",
            vec![gzip(&[
                File(&real[1..], &module, 0o644),
                Symlink("lib", "usr/lib"),
            ])],
        ),
        (
            "absolute target",
            vec![gzip(&[
                Symlink("lib", "/usr/lib"),
                File(&real[1..], &module, 0o644),
            ])],
        ),
        (
            "`..` above the root stays at the root",
            vec![gzip(&[
                Symlink("lib", "../../../usr/./lib"),
                File(&real[1..], &module, 0o644),
            ])],
        ),
        (
            "the written path goes through the link",
            vec![gzip(&[
                Dir("usr/lib"),
                Symlink("lib", "usr/lib"),
                File(&listed[1..], &module, 0o644),
            ])],
        ),
    ] {
        let layer = sign(layers, &[listed]).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(layer.files[0].path, listed, "{what}");
        assert_eq!(layer.files[0].stored_at, real, "{what}");
        let entries = entries(&layer);
        assert_eq!(entries.len(), 1, "{what}");
        assert_eq!(entries[0].0, real[1..], "{what}");
        assert_eq!(entries[0].5, signed(&module, listed), "{what}");
    }

    // A link to the file itself, under another name: followed when it comes first...
    let versioned = "opt/lib/modules/6.1.0-47-amd64/extra/kmm_hello-1.2.ko";
    let layer = sign(
        vec![
            gzip(&[Symlink(&KO[1..], "kmm_hello-1.2.ko")]),
            gzip(&[File(versioned, &module, 0o644)]),
        ],
        &[KO],
    )
    .unwrap();
    assert_eq!(layer.files[0].stored_at, format!("/{versioned}"));
    // ...and reported, naming the path to list, when it comes after the file.
    let err = sign(
        vec![
            gzip(&[File(versioned, &module, 0o644)]),
            gzip(&[Symlink(&KO[1..], "kmm_hello-1.2.ko")]),
        ],
        &[KO],
    )
    .unwrap_err();
    assert!(matches!(err, SignError::LinkedAfterWrite { .. }), "{err:?}");
    assert!(err.to_string().contains(&format!("/{versioned}")), "{err}");

    // A loop, and a link to nothing.
    let err = sign(
        vec![gzip(&[Symlink("a", "b"), Symlink("b", "a")])],
        &["/a/x.ko"],
    )
    .unwrap_err();
    assert!(
        matches!(&err, SignError::LinkLoop { path } if path == "/a/x.ko"),
        "{err:?}"
    );
    let err = sign(vec![gzip(&[Symlink(&KO[1..], "gone.ko")])], &[KO]).unwrap_err();
    assert!(matches!(err, SignError::FileNotInImage { .. }), "{err:?}");
}

#[test]
fn every_layer_compression_is_read() {
    let module = elf_module(1_000, 60);
    let plain = tar(&[File(&KO[1..], b"\x7fELF older", 0o644)]);
    let zstd = zstd::encode_all(tar(&[File(&KO[1..], &module, 0o644)]).as_slice(), 3).unwrap();
    let layers = vec![
        Layer {
            compression: Compression::None,
            reader: Cursor::new(plain),
        },
        gzip(&[File("x", b"", 0o644)]),
        Layer {
            compression: Compression::Zstd,
            reader: Cursor::new(zstd),
        },
    ];
    let layer = sign(layers, &[KO]).unwrap();
    assert_eq!(entries(&layer)[0].5, signed(&module, KO));
}

#[test]
fn hostile_and_oversized_layers_are_refused() {
    let module = elf_module(10_000, 70);
    let (_, key) = shared();
    let files = [KO.to_string()];
    let run = |layers: Vec<Layer<Cursor<Vec<u8>>>>, limits: Limits| {
        sign_files_in_layers(layers, &files, key, HashAlgorithm::Sha256, &limits).unwrap_err()
    };
    let image = || {
        vec![gzip(&[
            Dir("opt"),
            File("opt/other", &[0; 20_000], 0o644),
            File(&KO[1..], &module, 0o644),
        ])]
    };

    let err = run(
        image(),
        Limits {
            max_file_bytes: 9_999,
            ..Limits::default()
        },
    );
    assert!(
        matches!(&err, SignError::FileTooLarge { path, size: 10_000, .. } if path == KO),
        "{err:?}"
    );
    let err = run(
        image(),
        Limits {
            max_entries: 2,
            ..Limits::default()
        },
    );
    assert!(
        matches!(err, SignError::TooManyEntries { limit: 2 }),
        "{err:?}"
    );
    let err = run(
        image(),
        Limits {
            max_layer_bytes: 20_000,
            ..Limits::default()
        },
    );
    assert!(
        matches!(err, SignError::LayerTooLarge { layer: 0, .. }),
        "{err:?}"
    );
    // Files of the listed name elsewhere are read too, and count.
    let other = "opt/lib/modules/6.1.0-48-amd64/extra/kmm_hello.ko";
    let err = run(
        vec![gzip(&[
            File(other, &module, 0o644),
            File(&KO[1..], &module, 0o644),
        ])],
        Limits {
            max_read_bytes: 15_000,
            ..Limits::default()
        },
    );
    assert!(matches!(err, SignError::TooMuchToRead { .. }), "{err:?}");

    for (name, reason) in [("../etc/passwd", "`..`"), ("/etc/passwd", "absolute")] {
        let err = run(
            vec![gzip(&[File(&KO[1..], &module, 0o644)]), gzip(&[Raw(name)])],
            Limits::default(),
        );
        assert!(
            matches!(err, SignError::UnsafeEntry { layer: 1, .. }),
            "{err:?}"
        );
        assert!(
            err.to_string().contains(name) && err.to_string().contains(reason),
            "{err}"
        );
    }
    let err = run(
        vec![Layer {
            compression: Compression::Gzip,
            reader: Cursor::new(b"not gzip".to_vec()),
        }],
        Limits::default(),
    );
    assert!(
        matches!(err, SignError::CorruptLayer { layer: 0, .. }),
        "{err:?}"
    );
}

#[test]
fn the_node_agent_extracts_the_signed_module_from_the_image_plus_the_layer() {
    let module = elf_module(2_000, 80);
    let image = || {
        vec![gzip(&[
            Dir("opt/lib/modules/6.1.0-47-amd64/extra"),
            File(&KO[1..], &module, 0o644),
            File(
                "opt/lib/modules/6.1.0-47-amd64/modules.dep",
                b"extra/kmm_hello.ko:\n",
                0o644,
            ),
        ])]
    };
    let layer = sign(image(), &[KO]).unwrap();
    let mut layers = image();
    layers.push(Layer {
        compression: Compression::Gzip,
        reader: Cursor::new(layer.blob.clone()),
    });
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    kmm_extract::extract_image(
        layers,
        &kmm_extract::Selection {
            dir_name: "/opt".into(),
            kernel: "6.1.0-47-amd64".into(),
            firmware_path: None,
            host_modules: None,
        },
        &kmm_extract::Limits::default(),
        &root,
    )
    .unwrap();
    assert_eq!(
        sha256(&std::fs::read(root.join(&KO[1..])).unwrap()),
        signed(&module, KO)
    );
    assert_eq!(
        std::fs::read(root.join("opt/lib/modules/6.1.0-47-amd64/modules.dep")).unwrap(),
        b"extra/kmm_hello.ko:\n"
    );
}

#[test]
fn debug_does_not_print_the_blob() {
    let layer = sign(
        vec![gzip(&[File(&KO[1..], &elf_module(100_000, 90), 0o644)])],
        &[KO],
    )
    .unwrap();
    let debug = format!("{layer:?}");
    assert!(
        debug.contains(&format!("<{} bytes>", layer.blob.len())),
        "{debug}"
    );
    assert!(debug.len() < 1_000, "{debug}");
}
