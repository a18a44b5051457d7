//! Reading samples out of a Prometheus text exposition (what every kmm process serves on
//! `/metrics`): a gauge by name, a histogram's sum and count by one label. Pure, for the
//! benches that turn the components' metrics into figures.

/// A line that is not a sample of the text format.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("metrics line {line}: {reason}: {text:?}")]
pub struct MetricsTextError {
    /// 1-based.
    pub line: usize,
    pub text: String,
    pub reason: &'static str,
}

/// A sample's labels: names, and values with their escapes undone.
pub type Labels<'a> = Vec<(&'a str, String)>;

/// One sample: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Labels<'a>,
    pub value: f64,
}

impl Sample<'_> {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Every sample of `text`, in order; comments and blank lines skipped.
pub fn samples(text: &str) -> Result<Vec<Sample<'_>>, MetricsTextError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|(i, l)| {
            sample(l).map_err(|reason| MetricsTextError {
                line: i + 1,
                text: l.to_owned(),
                reason,
            })
        })
        .collect()
}

fn sample(line: &str) -> Result<Sample<'_>, &'static str> {
    let name_end = line.find(['{', ' ']).ok_or("no value")?;
    let name = &line[..name_end];
    if name.is_empty() {
        return Err("no metric name");
    }
    let (labels, rest) = match line[name_end..].strip_prefix('{') {
        Some(after) => labels(after)?,
        None => (vec![], &line[name_end..]),
    };
    let value = rest.split_whitespace().next().ok_or("no value")?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse().map_err(|_| "the value is not a number")?,
    };
    Ok(Sample {
        name,
        labels,
        value,
    })
}

/// `k="v",...}` and what follows the closing brace.
fn labels(mut text: &str) -> Result<(Labels<'_>, &str), &'static str> {
    let mut labels = vec![];
    loop {
        text = text.trim_start_matches([' ', ',']);
        if let Some(rest) = text.strip_prefix('}') {
            return Ok((labels, rest));
        }
        let (name, rest) = text
            .split_once("=\"")
            .ok_or("a label without a quoted value")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next().ok_or("an unterminated label value")? {
                (i, '"') => break i,
                (_, '\\') => match chars.next().ok_or("an unterminated label value")?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                (_, c) => value.push(c),
            }
        };
        labels.push((name.trim(), value));
        text = &rest[end + 1..];
    }
}

/// The value of the gauge (or counter) `name` without labels; `None` when `text` has no
/// such series.
pub fn gauge(text: &str, name: &str) -> Result<Option<f64>, MetricsTextError> {
    Ok(samples(text)?
        .into_iter()
        .find(|s| s.name == name && s.labels.is_empty())
        .map(|s| s.value))
}

/// A histogram series' running totals.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SumCount {
    pub sum: f64,
    pub count: f64,
}

/// The sum and count of histogram `name`'s series labelled `label`; `None` when `text`
/// has neither.
pub fn histogram(
    text: &str,
    name: &str,
    label: (&str, &str),
) -> Result<Option<SumCount>, MetricsTextError> {
    let (sum_name, count_name) = (format!("{name}_sum"), format!("{name}_count"));
    let mut found = None::<SumCount>;
    for sample in samples(text)? {
        if sample.label(label.0) != Some(label.1) {
            continue;
        }
        if sample.name == sum_name {
            found.get_or_insert_default().sum = sample.value;
        } else if sample.name == count_name {
            found.get_or_insert_default().count = sample.value;
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP kmm_agent_load_last_finished_timestamp_seconds When.
# TYPE kmm_agent_load_last_finished_timestamp_seconds gauge
kmm_agent_load_last_finished_timestamp_seconds 1733000000.123456
kmm_agent_loads_total{outcome="succeeded"} 3
kmm_agent_load_step_duration_seconds_sum{step="pull"} 0.25
kmm_agent_load_step_duration_seconds_count{step="pull"} 2
kmm_agent_load_step_duration_seconds_bucket{le="+Inf",step="pull"} 2
kmm_agent_load_step_duration_seconds_sum{step="modprobe"} 0.006
kmm_agent_load_step_duration_seconds_count{step="modprobe"} 3
odd{text="a \"quoted\", b\\c",other="x"} 1 1733000000000

# EOF
"#;

    #[test]
    fn a_gauge_is_read_by_name_and_an_absent_one_is_none() {
        assert_eq!(
            gauge(TEXT, "kmm_agent_load_last_finished_timestamp_seconds").unwrap(),
            Some(1_733_000_000.123_456)
        );
        assert_eq!(gauge(TEXT, "kmm_agent_absent").unwrap(), None);
        // A labelled series is no plain gauge.
        assert_eq!(gauge(TEXT, "kmm_agent_loads_total").unwrap(), None);
    }

    #[test]
    fn a_histogram_series_is_read_by_its_label() {
        let name = "kmm_agent_load_step_duration_seconds";
        assert_eq!(
            histogram(TEXT, name, ("step", "pull")).unwrap(),
            Some(SumCount {
                sum: 0.25,
                count: 2.0
            })
        );
        assert_eq!(
            histogram(TEXT, name, ("step", "modprobe")).unwrap(),
            Some(SumCount {
                sum: 0.006,
                count: 3.0
            })
        );
        assert_eq!(histogram(TEXT, name, ("step", "extract")).unwrap(), None);
    }

    #[test]
    fn label_values_keep_their_escapes_and_infinity_reads() {
        let all = samples(TEXT).unwrap();
        let odd = all.iter().find(|s| s.name == "odd").unwrap();
        assert_eq!(odd.label("text"), Some(r#"a "quoted", b\c"#));
        assert_eq!(odd.label("other"), Some("x"));
        assert_eq!(odd.value, 1.0, "the timestamp is not the value");
        let inf = all.iter().find(|s| s.name.ends_with("_bucket")).unwrap();
        assert_eq!(inf.label("le"), Some("+Inf"));
    }

    #[test]
    fn a_line_that_is_no_sample_is_named() {
        let error = samples("ok 1\nbroken{step=\"pull} 1\n").unwrap_err();
        assert_eq!(error.line, 2);
        assert_eq!(error.reason, "an unterminated label value");
        assert!(error.to_string().contains("broken{step"), "{error}");
        let error = samples("kmm_hub_leader one\n").unwrap_err();
        assert_eq!(error.reason, "the value is not a number");
        assert_eq!(samples("lonely\n").unwrap_err().reason, "no value");
    }
}
