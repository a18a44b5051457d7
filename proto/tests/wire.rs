//! The wire format is a contract between binaries of different versions: field numbers
//! must never change. These golden encodings fail if one does.

use kmm_proto::v1::{
    AgentHello, ImageResolution, IntentSnapshot, Kernel, KernelInventory, KernelTarget,
    LoadedModule, Modprobe, ModuleIntent, ModuleKey, ModuleLoad, ProxyMessage, PullCredential,
    SpokeImage, SpokeImageReport, Unresolved, kernel_target::Target, proxy_message,
    pull_credential::Content, spoke_image,
};
use prost::Message;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn key() -> ModuleKey {
    ModuleKey {
        namespace: "ns".into(),
        name: "m".into(),
    }
}

#[test]
fn intent_snapshot_encoding_is_stable() {
    let snapshot = IntentSnapshot {
        revision: 7,
        modules: vec![ModuleIntent {
            key: Some(key()),
            generation: 3,
            kernels: vec![KernelTarget {
                kernel: "6.1.0".into(),
                target: Some(Target::Load(ModuleLoad {
                    image: "r/x:v1".into(),
                    modprobe: Some(Modprobe {
                        module_name: "m".into(),
                        dir_name: "/opt".into(),
                        ..Modprobe::default()
                    }),
                    version: "1".into(),
                    pull_credential_id: "c".into(),
                    ..ModuleLoad::default()
                })),
            }],
            unload: true,
            ..ModuleIntent::default()
        }],
        credentials: vec![PullCredential {
            id: "c".into(),
            content: Some(Content::DockerConfigJson(b"{}".to_vec())),
        }],
        ..IntentSnapshot::default()
    };
    let bytes = snapshot.encode_to_vec();
    assert_eq!(
        hex(&bytes),
        // revision 7; modules[0]: key, generation 3, kernels[0] (kernel, load: image,
        // modprobe, version, credential id), unload; credentials[0].
        "080712310a070a026e7312016d10032a220a05362e312e3012190a06722f783a7631\
         1a090a016d1a042f6f70742a0131320163\
         3001\
         1a070a016312027b7d"
    );
    assert_eq!(IntentSnapshot::decode(bytes.as_slice()).unwrap(), snapshot);
}

#[test]
fn agent_hello_encoding_is_stable() {
    let hello = AgentHello {
        node_name: "n".into(),
        boot_id: "b".into(),
        kernel_release: "k".into(),
        agent_version: "v".into(),
        loaded: vec![LoadedModule {
            key: Some(key()),
            version: "1".into(),
            image_digest: "d".into(),
        }],
    };
    let bytes = hello.encode_to_vec();
    assert_eq!(
        hex(&bytes),
        "0a016e1201621a016b2201762a0f0a070a026e7312016d1201311a0164"
    );
    assert_eq!(AgentHello::decode(bytes.as_slice()).unwrap(), hello);
}

#[test]
fn kernel_inventory_encoding_is_stable_and_reads_older_proxies() {
    let inventory = KernelInventory {
        revision: 5,
        kernels: vec![Kernel {
            release: "6.1".into(),
        }],
    };
    let bytes = inventory.encode_to_vec();
    // revision 5; kernels[0]: release.
    assert_eq!(hex(&bytes), "080512050a03362e31");
    // An older proxy also sent the kernels' OS image (field 2) and node count (field 3),
    // numbers now reserved: the hub reads such an inventory as the same kernels.
    let older = [
        0x08, 0x05, 0x12, 0x0a, 0x0a, 0x03, b'6', b'.', b'1', 0x12, 0x01, b'D', 0x18, 0x03,
    ];
    assert_eq!(
        KernelInventory::decode(older.as_slice()).unwrap(),
        inventory
    );
}

#[test]
fn spoke_resolution_encodings_are_stable() {
    let target = KernelTarget {
        kernel: "6.1".into(),
        target: Some(Target::Resolve(ImageResolution {
            load: Some(ModuleLoad {
                image: "r/x:v1".into(),
                ..ModuleLoad::default()
            }),
            image_generation: 2,
            failed: None,
        })),
    };
    let bytes = target.encode_to_vec();
    // kernel; resolve (field 4): load (image), image_generation 2.
    assert_eq!(hex(&bytes), "0a03362e31220c0a080a06722f783a76311002");
    assert_eq!(KernelTarget::decode(bytes.as_slice()).unwrap(), target);
    // A failed last answer rides along (field 3 of the resolution): reason "R".
    let mut failed = target.clone();
    if let Some(Target::Resolve(resolution)) = &mut failed.target {
        resolution.failed = Some(Unresolved {
            reason: "R".into(),
            message: String::new(),
        });
    }
    let bytes = failed.encode_to_vec();
    assert_eq!(
        hex(&bytes),
        "0a03362e3122110a080a06722f783a763110021a030a0152"
    );
    assert_eq!(KernelTarget::decode(bytes.as_slice()).unwrap(), failed);

    let report = ProxyMessage {
        message: Some(proxy_message::Message::SpokeImages(SpokeImageReport {
            images: vec![
                SpokeImage {
                    module: Some(key()),
                    image: "r/x:v1".into(),
                    image_generation: 2,
                    result: Some(spoke_image::Result::Digest("sha256:a".into())),
                },
                SpokeImage {
                    module: Some(key()),
                    image: "r/y:v1".into(),
                    image_generation: 0,
                    result: Some(spoke_image::Result::Failure(Unresolved {
                        reason: "ImageNotFound".into(),
                        message: "m".into(),
                    })),
                },
            ],
        })),
    };
    let bytes = report.encode_to_vec();
    // spoke_images (field 5): images[0] (module, image, generation 2, digest),
    // images[1] (module, image, failure: reason, message).
    assert_eq!(
        hex(&bytes),
        "2a460a1d0a070a026e7312016d1206722f783a7631180222087368613235363a61\
         0a250a070a026e7312016d1206722f793a76312a120a0d496d6167654e6f74466f756e6412016d"
    );
    assert_eq!(ProxyMessage::decode(bytes.as_slice()).unwrap(), report);
}
