//! Compiles kmm/v1/*.proto with protox (pure Rust), so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "kmm/v1/module.proto",
        "kmm/v1/hub.proto",
        "kmm/v1/agent.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["."])?;
    tonic_prost_build::configure()
        // Ordered maps encode the same way every time, so a snapshot's digest is stable.
        .btree_map(".")
        .codec_path("crate::codec::FleetCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
