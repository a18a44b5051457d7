//! The line protocol of the guest's command channel (its second serial port, served by
//! `e2e/guest/init`): one shell command per line down, one framed result per line up.
//! Both directions are base64 so that no command or output can break the framing.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

/// What the guest's init reports.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    /// Setup finished; the guest's uptime in seconds then.
    Ready { uptime_seconds: f64 },
    /// Setup failed; the guest powers off.
    Failed(String),
    /// A command finished.
    Output { id: u64, code: i32, output: String },
}

/// The line that runs `command` as command `id`.
pub fn request(id: u64, command: &str) -> String {
    format!("{id} {}\n", STANDARD.encode(command))
}

/// The frame a line carries; `None` for anything else (noise on the port).
pub fn parse(line: &str) -> Result<Option<Frame>, String> {
    let line = line.trim_end_matches(['\r', '\n']);
    let Some(rest) = line.find("@@KMM-").map(|at| &line[at + "@@KMM-".len()..]) else {
        return Ok(None);
    };
    let (kind, rest) = rest.split_once(' ').unwrap_or((rest, ""));
    match kind {
        "READY" => rest
            .trim()
            .parse()
            .map(|uptime_seconds| Some(Frame::Ready { uptime_seconds }))
            .map_err(|e| format!("READY uptime `{rest}`: {e}")),
        "FAIL" => Ok(Some(Frame::Failed(rest.to_string()))),
        "OUT" => {
            let mut fields = rest.splitn(3, ' ');
            let id = fields.next().unwrap_or_default();
            let code = fields.next().unwrap_or_default();
            let output = fields.next().unwrap_or_default().trim();
            let id = id.parse().map_err(|e| format!("OUT id `{id}`: {e}"))?;
            let code = code
                .parse()
                .map_err(|e| format!("OUT code `{code}`: {e}"))?;
            let output = STANDARD
                .decode(output)
                .map_err(|e| format!("OUT {id} output: {e}"))?;
            Ok(Some(Frame::Output {
                id,
                code,
                output: String::from_utf8_lossy(&output).into_owned(),
            }))
        }
        other => Err(format!("unknown frame `{other}` in `{line}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_the_id_and_the_encoded_command() {
        assert_eq!(request(7, "echo 'a b'\n"), "7 ZWNobyAnYSBiJwo=\n");
    }

    #[test]
    fn frames_are_recognised_and_decoded() {
        assert_eq!(
            parse("@@KMM-READY 1.52\n"),
            Ok(Some(Frame::Ready {
                uptime_seconds: 1.52
            }))
        );
        assert_eq!(
            parse("@@KMM-OUT 7 1 aGVsbG8K\r\n"),
            Ok(Some(Frame::Output {
                id: 7,
                code: 1,
                output: "hello\n".into()
            }))
        );
        assert_eq!(
            parse("@@KMM-OUT 8 0 "),
            Ok(Some(Frame::Output {
                id: 8,
                code: 0,
                output: String::new()
            }))
        );
        assert_eq!(
            parse("@@KMM-FAIL mount /dev/vda"),
            Ok(Some(Frame::Failed("mount /dev/vda".into())))
        );
    }

    #[test]
    fn noise_before_a_frame_is_skipped_and_other_lines_ignored() {
        assert_eq!(
            parse("\u{0}garbage@@KMM-READY 3"),
            Ok(Some(Frame::Ready {
                uptime_seconds: 3.0
            }))
        );
        assert_eq!(parse("[    1.2] random kernel line"), Ok(None));
    }

    #[test]
    fn malformed_frames_say_what_is_wrong() {
        assert!(parse("@@KMM-OUT x 0 aGk=").unwrap_err().contains("id `x`"));
        assert!(
            parse("@@KMM-OUT 1 z aGk=")
                .unwrap_err()
                .contains("code `z`")
        );
        assert!(parse("@@KMM-OUT 1 0 !!").unwrap_err().contains("output"));
        assert!(parse("@@KMM-READY soon").unwrap_err().contains("soon"));
        assert!(parse("@@KMM-WHAT").unwrap_err().contains("WHAT"));
    }
}
