//! Resolution of whole module specs, as the hub and `kmm-hub render` use it.

use kmm_api::ModuleSpec;
use kmm_resolver::{
    MatchedBy, ModuleIdentity, ResolveErrorKind, Resolver, template::TemplateError,
};

const IDENTITY: ModuleIdentity<'static> = ModuleIdentity {
    name: "hello",
    namespace: "drivers",
    spec_path: "spec.moduleSpec",
};

fn spec(yaml: &str) -> ModuleSpec {
    serde_yaml_ng::from_str(yaml).expect("test spec parses")
}

const MAPPINGS: &str = r#"
selector: {}
moduleLoader:
  container:
    containerImage: reg.example/default/${MOD_NAMESPACE}-${MOD_NAME}:${KERNEL_XYZ}
    modprobe: {moduleName: hello}
    kernelMappings:
      - literal: 6.1.0-13-amd64
        containerImage: reg.example/exact:v1
      - regexp: 'amd64$'
        containerImage: reg.example/debian:${KERNEL_DEBIAN_RELEASE}-${KERNEL_DEBIAN_FLAVOR}
      - regexp: 'el9'
      - regexp: '\.fc\d+\.'
        containerImage: reg.example/fedora:${KERNEL_RHEL_VERSION}
      - regexp: 'rt'
        containerImage: reg.example/rt:${KERNEL_FULL_VERSION}
"#;

#[test]
fn first_matching_mapping_wins_and_literal_is_exact() {
    let spec = spec(MAPPINGS);
    let resolver = Resolver::new(&spec, IDENTITY).unwrap();

    let exact = resolver.resolve("6.1.0-13-amd64").unwrap();
    assert_eq!(exact.mapping_index, 0);
    assert_eq!(
        exact.matched_by,
        MatchedBy::Literal("6.1.0-13-amd64".into())
    );
    assert_eq!(exact.container_image, "reg.example/exact:v1");

    let other = resolver.resolve("6.1.0-18-cloud-amd64").unwrap();
    assert_eq!(other.mapping_index, 1);
    assert_eq!(other.container_image, "reg.example/debian:18-cloud-amd64");
    assert_eq!(
        other.variables.keys().collect::<Vec<_>>(),
        ["KERNEL_DEBIAN_FLAVOR", "KERNEL_DEBIAN_RELEASE"]
    );
}

#[test]
fn container_image_and_module_variables_fill_in() {
    let spec = spec(MAPPINGS);
    let resolver = Resolver::new(&spec, IDENTITY).unwrap();
    let r = resolver.resolve("5.14.0-427.13.1.el9_4.x86_64").unwrap();
    assert_eq!(r.mapping_index, 2);
    assert_eq!(
        r.container_image,
        "reg.example/default/drivers-hello:5.14.0"
    );
    assert_eq!(r.modprobe.dir_name.as_deref(), Some("/opt"));
}

#[test]
fn trailing_plus_is_trimmed_before_matching() {
    let spec = spec(
        r#"
selector: {}
moduleLoader:
  container:
    modprobe: {moduleName: hello}
    kernelMappings:
      - literal: 6.1.75
        containerImage: reg.example/cos:${KERNEL_FULL_VERSION}
"#,
    );
    let r = Resolver::new(&spec, IDENTITY)
        .unwrap()
        .resolve("6.1.75+")
        .unwrap();
    assert_eq!(r.kernel, "6.1.75+");
    assert_eq!(r.container_image, "reg.example/cos:6.1.75");
}

#[test]
fn unmatched_kernel_names_kernel_and_field() {
    let spec = spec(MAPPINGS);
    let err = Resolver::new(&spec, IDENTITY)
        .unwrap()
        .resolve("5.4.0-104-generic")
        .unwrap_err();
    assert_eq!(err.kind, ResolveErrorKind::NoMatchingMapping);
    assert_eq!(
        err.to_string(),
        "kernel 5.4.0-104-generic: spec.moduleSpec.moduleLoader.container.kernelMappings: \
         no kernel mapping matches this kernel"
    );
}

#[test]
fn undefined_variable_is_an_error_naming_variable_kernel_and_field() {
    let spec = spec(MAPPINGS);
    let err = Resolver::new(&spec, IDENTITY)
        .unwrap()
        .resolve("6.5.6-300.fc39.x86_64")
        .unwrap_err();
    assert_eq!(
        err.kind,
        ResolveErrorKind::Template(TemplateError::Undefined {
            name: "KERNEL_RHEL_VERSION".into()
        })
    );
    assert_eq!(
        err.field,
        "spec.moduleSpec.moduleLoader.container.kernelMappings[3].containerImage"
    );
    let text = err.to_string();
    assert!(
        text.contains("6.5.6-300.fc39.x86_64") && text.contains("KERNEL_RHEL_VERSION"),
        "{text}"
    );
}

#[test]
fn substituted_image_must_be_a_valid_reference() {
    let spec = spec(MAPPINGS);
    // `+` is not allowed in a tag: the kernel release cannot be used verbatim.
    let err = Resolver::new(&spec, IDENTITY)
        .unwrap()
        .resolve("5.14.0-570.12.1.el8_6.x86_64+rt")
        .unwrap_err();
    assert!(matches!(err.kind, ResolveErrorKind::Image(_)), "{err}");
    assert_eq!(
        err.field,
        "spec.moduleSpec.moduleLoader.container.kernelMappings[4].containerImage"
    );
}

#[test]
fn in_tree_removals_registry_tls_and_version_follow_the_mapping() {
    let spec = spec(
        r#"
selector: {}
moduleLoader:
  container:
    version: v2
    imagePullPolicy: Always
    registryTLS: {insecure: true}
    inTreeModulesToRemove: [a, b]
    modprobe: {moduleName: hello, dirName: /srv, modulesLoadingOrder: [hello, helper]}
    kernelMappings:
      - regexp: special
        containerImage: r.example/x:special
        registryTLS: {insecureSkipTLSVerify: true}
        inTreeModulesToRemove: [c]
      - regexp: '.*'
        containerImage: r.example/x:any
"#,
    );
    let resolver = Resolver::new(&spec, IDENTITY).unwrap();
    let special = resolver.resolve("6.1.0-special").unwrap();
    assert_eq!(special.in_tree_modules_to_remove, ["c"]);
    assert_eq!(
        special.registry_tls.unwrap().insecure_skip_tls_verify,
        Some(true)
    );
    assert_eq!(special.version.as_deref(), Some("v2"));
    assert_eq!(special.image_pull_policy.as_deref(), Some("Always"));
    assert_eq!(special.modprobe.dir_name.as_deref(), Some("/srv"));
    let any = resolver.resolve("6.1.0").unwrap();
    assert_eq!(any.in_tree_modules_to_remove, ["a", "b"]);
    assert_eq!(any.registry_tls.unwrap().insecure, Some(true));
}

#[test]
fn sign_is_merged_and_substituted() {
    let spec = spec(
        r#"
selector: {}
moduleLoader:
  container:
    modprobe: {moduleName: hello}
    sign:
      keySecret: {name: key}
      certSecret: {name: cert}
      unsignedImage: r.example/unsigned:${KERNEL_FULL_VERSION}
      filesToSign: ['/opt/lib/modules/${KERNEL_FULL_VERSION}/hello.ko']
    kernelMappings:
      - regexp: cloud
        containerImage: r.example/signed:${KERNEL_FULL_VERSION}
        sign:
          keySecret: {name: cloud-key}
          certSecret: {name: cloud-cert}
          filesToSign: ['/opt/lib/modules/${KERNEL_FULL_VERSION}/helper.ko']
      - regexp: '.'
        containerImage: r.example/signed:${KERNEL_FULL_VERSION}
"#,
    );
    let resolver = Resolver::new(&spec, IDENTITY).unwrap();
    let sign = resolver
        .resolve("6.1.0-18-cloud-amd64")
        .unwrap()
        .sign
        .unwrap();
    assert_eq!(sign.key_secret.name, "cloud-key");
    assert_eq!(
        sign.unsigned_image.as_deref(),
        Some("r.example/unsigned:6.1.0-18-cloud-amd64")
    );
    assert_eq!(
        sign.files_to_sign.unwrap(),
        [
            "/opt/lib/modules/6.1.0-18-cloud-amd64/hello.ko",
            "/opt/lib/modules/6.1.0-18-cloud-amd64/helper.ko"
        ]
    );
}

#[test]
fn sign_without_files_or_image_is_refused() {
    let no_files = spec(
        r#"
selector: {}
moduleLoader:
  container:
    modprobe: {moduleName: hello}
    kernelMappings:
      - regexp: '.'
        containerImage: r.example/signed:v1
        sign: {keySecret: {name: k}, certSecret: {name: c}, unsignedImage: r.example/u:v1}
"#,
    );
    let err = Resolver::new(&no_files, IDENTITY)
        .unwrap()
        .resolve("6.1.0")
        .unwrap_err();
    assert_eq!(err.kind, ResolveErrorKind::NothingToSign);
    assert_eq!(
        err.field,
        "spec.moduleSpec.moduleLoader.container.kernelMappings[0].sign.filesToSign"
    );

    let no_image = spec(
        r#"
selector: {}
moduleLoader:
  container:
    modprobe: {moduleName: hello}
    kernelMappings:
      - regexp: '.'
        containerImage: r.example/signed:v1
        sign: {keySecret: {name: k}, certSecret: {name: c}, filesToSign: [/opt/x.ko]}
"#,
    );
    let err = Resolver::new(&no_image, IDENTITY)
        .unwrap()
        .resolve("6.1.0")
        .unwrap_err();
    assert_eq!(err.kind, ResolveErrorKind::NoUnsignedImage);
}

#[test]
fn build_is_merged_into_the_resolution() {
    let spec = spec(
        r#"
selector: {}
moduleLoader:
  container:
    modprobe: {moduleName: hello}
    build:
      dockerfileConfigMap: {name: df}
      buildArgs: [{name: A, value: "1"}]
    kernelMappings:
      - regexp: '.'
        containerImage: r.example/built:${KERNEL_FULL_VERSION}
        build:
          dockerfileConfigMap: {name: df-special}
          buildArgs: [{name: A, value: "2"}]
"#,
    );
    let build = Resolver::new(&spec, IDENTITY)
        .unwrap()
        .resolve("6.1.0")
        .unwrap()
        .build
        .unwrap();
    assert_eq!(build.dockerfile_config_map.name, "df-special");
    assert_eq!(build.build_args.unwrap()[0].value, "2");
}

#[test]
fn no_module_loader_is_reported() {
    let spec = spec("selector: {}\ndevicePlugin:\n  container: {image: r.example/plugin:1}\n");
    let err = Resolver::new(&spec, IDENTITY)
        .unwrap()
        .resolve("6.1.0")
        .unwrap_err();
    assert_eq!(err.kind, ResolveErrorKind::NoModuleLoader);
    assert_eq!(err.field, "spec.moduleSpec.moduleLoader");
}
