use super::*;

/// A plain tar of regular files; names are written as raw bytes, hostile ones included.
fn tar(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut header = tar::Header::new_gnu();
        header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        header.set_entry_type(tar::EntryType::Regular);
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder.append(&header, *data).unwrap();
    }
    builder.into_inner().unwrap()
}

fn plain(data: Vec<u8>) -> Layer<io::Cursor<Vec<u8>>> {
    Layer {
        compression: Compression::None,
        reader: io::Cursor::new(data),
    }
}

#[test]
fn paths_are_normalised_and_checked_when_asked_for() {
    let layers = [
        plain(tar(&[("./a//b/.", b""), ("./", b""), ("/abs", b"")])),
        plain(tar(&[("a/../b", b"")])),
    ];
    let mut seen = Vec::new();
    walk(layers, u64::MAX, |entry| {
        seen.push((entry.layer(), entry.path()));
        Ok::<_, LayerError>(())
    })
    .unwrap();
    let [
        (0, Ok(ab)),
        (0, Ok(root)),
        (0, Err(absolute)),
        (1, Err(parent)),
    ] = &seen[..]
    else {
        panic!("{seen:?}");
    };
    assert_eq!(ab.components(), [b"a".to_vec(), b"b".to_vec()]);
    assert_eq!(ab.to_string(), "./a//b/.");
    assert!(root.components().is_empty());
    assert!(
        matches!(absolute, LayerError::AbsolutePath { layer: 0, path } if path == "/abs"),
        "{absolute}"
    );
    assert!(
        matches!(parent, LayerError::ParentTraversal { layer: 1, .. }),
        "{parent}"
    );
}

#[test]
fn the_read_limit_wins_over_the_visitors_error() {
    let err = walk([plain(tar(&[("big", &[0; 4096])]))], 1024, |mut entry| {
        entry.copy_to("big", &mut io::sink())
    })
    .unwrap_err();
    assert!(
        matches!(
            err,
            LayerError::TooLarge {
                layer: 0,
                limit: 1024
            }
        ),
        "{err}"
    );
}

#[test]
fn a_file_shorter_than_declared_is_corrupt() {
    let mut data = tar(&[("short", &[1; 100])]);
    data.truncate(512 + 10);
    let err = walk([plain(data)], u64::MAX, |mut entry| {
        entry.copy_to("short", &mut Vec::new())
    })
    .unwrap_err();
    assert!(matches!(err, LayerError::Corrupt { layer: 0, .. }), "{err}");
    assert!(err.to_string().contains("short: 10 of 100 bytes"), "{err}");
}
