//! `kmm-hub render` as a user runs it: exit codes, messages and output.

use std::process::{Command, Output};

use serde_json::Value;

const EXAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../docs/examples/kmm-hello.yaml"
);

fn render(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kmm-hub"))
        .arg("render")
        .args(args)
        .output()
        .expect("kmm-hub runs")
}

fn stdout_objects(output: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).expect("each line is a JSON object"))
        .collect()
}

#[test]
fn resolves_every_kernel_of_the_corpus_with_a_variable_per_family() {
    let corpus: Vec<Value> =
        serde_yaml_ng::from_str(include_str!("../resolver/tests/corpus/kernels.yaml")).unwrap();
    let dir = std::env::temp_dir().join(format!("kmm-render-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let doc = dir.join("corpus.yaml");
    std::fs::write(
        &doc,
        r#"
apiVersion: kmm.sigs.x-k8s.io/v1beta1
kind: Module
metadata: {name: corpus, namespace: drivers}
spec:
  selector: {}
  moduleLoader:
    container:
      modprobe: {moduleName: corpus}
      kernelMappings:
        - regexp: '\.el[0-9]+'
          containerImage: 'r.example/${MOD_NAMESPACE}/rhel:${KERNEL_RHEL_VERSION}-${KERNEL_RHEL_ARCH}'
        - regexp: '-(amd64|arm64)$'
          containerImage: 'r.example/debian:${KERNEL_DEBIAN_RELEASE}-${KERNEL_DEBIAN_FLAVOR}'
        - regexp: '-[0-9]+-[a-z]'
          containerImage: 'r.example/ubuntu:${KERNEL_UBUNTU_RELEASE}-${KERNEL_UBUNTU_FLAVOR}'
        - regexp: '.'
          containerImage: 'r.example/${MOD_NAME}:${KERNEL_XYZ}'
"#,
    )
    .unwrap();
    let mut args = vec![
        "-f".to_owned(),
        doc.display().to_string(),
        "-o".into(),
        "jsonl".into(),
    ];
    for entry in &corpus {
        args.push("--kernel".into());
        args.push(entry["release"].as_str().unwrap().to_owned());
    }
    let output = render(&args.iter().map(String::as_str).collect::<Vec<_>>());
    std::fs::remove_dir_all(&dir).unwrap();

    // Families the first mappings expect but a kernel lacks fail loudly, never silently.
    let stderr = String::from_utf8_lossy(&output.stderr);
    for line in stderr.lines() {
        assert!(
            line.starts_with("error: kernel ") && line.contains("is not defined"),
            "{line}"
        );
    }
    let objects = stdout_objects(&output);
    assert_eq!(objects.len() + stderr.lines().count(), corpus.len());
    for entry in &corpus {
        let release = entry["release"].as_str().unwrap();
        let Some(object) = objects.iter().find(|o| o["kernel"] == release) else {
            continue;
        };
        let image = object["containerImage"].as_str().unwrap();
        let expected = if let Some(rhel) = entry.get("rhel") {
            format!(
                "r.example/drivers/rhel:{}-{}",
                rhel["version"].as_str().unwrap(),
                rhel["arch"].as_str().unwrap()
            )
        } else if let Some(debian) = entry.get("debian") {
            format!(
                "r.example/debian:{}-{}",
                debian["release"].as_str().unwrap(),
                debian["flavor"].as_str().unwrap()
            )
        } else if let Some(ubuntu) = entry.get("ubuntu") {
            format!(
                "r.example/ubuntu:{}-{}",
                ubuntu["release"].as_str().unwrap(),
                ubuntu["flavor"].as_str().unwrap()
            )
        } else {
            let xyz: Vec<&str> = entry["xyz"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            format!("r.example/corpus:{}", xyz.join("."))
        };
        assert_eq!(image, expected, "kernel {release}");
        for key in [
            "kernel",
            "mappingIndex",
            "containerImage",
            "build",
            "sign",
            "modprobe",
            "inTreeModulesToRemove",
            "variables",
        ] {
            assert!(object.get(key).is_some(), "{key} missing for {release}");
        }
    }
    assert!(
        objects.len() >= 40,
        "only {} kernels resolved",
        objects.len()
    );
    assert_eq!(
        output.status.code(),
        Some(if stderr.is_empty() { 0 } else { 1 })
    );
}

#[test]
fn unmatched_kernel_exits_1_naming_kernel_and_field() {
    let output = render(&[
        "-f",
        EXAMPLE,
        "--kernel",
        "6.1.0-13-amd64",
        "--kernel",
        "6.6.54-flatcar",
    ]);
    assert_eq!(output.status.code(), Some(1));
    let printed: Vec<Value> = serde_json::Deserializer::from_slice(&output.stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .expect("stdout holds pretty-printed JSON objects");
    assert_eq!(
        printed.len(),
        1,
        "the kernel that resolved is still printed"
    );
    assert_eq!(printed[0]["kernel"], "6.1.0-13-amd64");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stderr.trim(),
        "error: kernel 6.6.54-flatcar: spec.moduleSpec.moduleLoader.container.kernelMappings: no kernel mapping matches this kernel"
    );
}

#[test]
fn invalid_spec_exits_2_with_every_problem() {
    let output = Command::new(env!("CARGO_BIN_EXE_kmm-hub"))
        .args(["render", "-f", "-", "--kernel", "6.1.0"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(
                br#"{"apiVersion":"hub.kmm.sigs.x-k8s.io/v1beta1","kind":"ManagedClusterModule",
                "metadata":{"name":"bad"},"spec":{"spokeNamespace":"ns","selector":{},"moduleSpec":{"selector":{},
                "moduleLoader":{"container":{"modprobe":{},"kernelMappings":[{"regexp":"(","containerImage":"r/x"}]}}}}}"#,
            )?;
            child.wait_with_output()
        })
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("ManagedClusterModule \"bad\" is invalid (3 problems)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("kernelMappings[0].regexp: \"(\": does not compile"),
        "{stderr}"
    );
    assert!(
        stderr
            .contains("kernelMappings[0].containerImage: \"r/x\": has neither a tag nor a digest"),
        "{stderr}"
    );
    assert!(
        stderr.contains("modprobe.moduleName: required unless rawArgs"),
        "{stderr}"
    );
}

#[test]
fn unreadable_or_mistyped_documents_exit_2_naming_the_field() {
    let missing = render(&["-f", "/nonexistent/module.yaml", "-k", "6.1.0"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/module.yaml: cannot read")
    );
}

#[test]
fn text_output_is_a_readable_summary() {
    let output = render(&[
        "-f",
        EXAMPLE,
        "-k",
        "5.14.0-427.13.1.el9_4.x86_64",
        "-o",
        "text",
    ]);
    assert_eq!(output.status.code(), Some(0));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        text.contains(
            "ManagedClusterModule kmm-demo/kmm-hello on kernel 5.14.0-427.13.1.el9_4.x86_64"
        ),
        "{text}"
    );
    assert!(
        text.contains("image        registry.example.com/samples/kmm-hello-el9_4:427.13.1.el9_4"),
        "{text}"
    );
    assert!(text.contains("remove first hello_legacy"), "{text}");
}

#[test]
fn an_upstream_mcm_with_every_field_renders() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../api/tests/fixtures/upstream-every-field.yaml"
    );
    let output = render(&[
        "-f",
        fixture,
        "-k",
        "4.18.0-513.24.1.el8_9.x86_64",
        "-o",
        "jsonl",
    ]);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let resolved = &stdout_objects(&output)[0];
    assert_eq!(resolved["mappingIndex"], 1);
    assert_eq!(
        resolved["build"]["dockerfileConfigMap"]["name"],
        "dockerfile-el8"
    );
    assert_eq!(resolved["sign"]["keySecret"]["name"], "el8-key");
    assert_eq!(
        resolved["inTreeModulesToRemove"],
        serde_json::json!(["nouveau"])
    );
}

#[test]
fn a_module_with_only_a_device_plugin_loads_nothing_on_any_kernel_and_exits_0() {
    let dir = std::env::temp_dir().join(format!("kmm-render-plugin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let doc = dir.join("plugin-only.yaml");
    std::fs::write(
        &doc,
        r#"
apiVersion: hub.kmm.sigs.x-k8s.io/v1beta1
kind: ManagedClusterModule
metadata: {name: plugin-only}
spec:
  spokeNamespace: drivers
  selector: {}
  moduleSpec:
    selector: {}
    devicePlugin:
      container: {image: r.example/plugin:1}
"#,
    )
    .unwrap();
    let path = doc.display().to_string();
    let output = render(&[
        "-f",
        &path,
        "-k",
        "6.1.0-13-amd64",
        "-k",
        "5.14.0-1",
        "-o",
        "jsonl",
    ]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let kernels: Vec<(String, bool)> = stdout_objects(&output)
        .iter()
        .map(|o| {
            (
                o["kernel"].as_str().unwrap().to_owned(),
                o["devicePluginOnly"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        kernels,
        [
            ("6.1.0-13-amd64".to_owned(), true),
            ("5.14.0-1".to_owned(), true)
        ]
    );
    let text = render(&["-f", &path, "-k", "6.1.0-13-amd64", "-o", "text"]);
    assert_eq!(text.status.code(), Some(0));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("nothing (no moduleLoader)"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}
