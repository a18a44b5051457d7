//! Compiles the kubelet device plugin API subset with protox (no system `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let file = "proto/v1beta1/deviceplugin.proto";
    println!("cargo:rerun-if-changed={file}");
    let descriptors = protox::compile([file], ["proto"])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
