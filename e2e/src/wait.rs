//! Waiting on the fleet by polling, with a deadline that reports what was last seen.
//! A leaf: the fleet and the fixture both wait, and neither is needed to.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// Poll `probe` until it yields `Some`, failing after `timeout` with `what` and the
/// last observation (the probe's `Err`), so a failed wait says what it saw.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match probe().await {
            Ok(value) => return Ok(value),
            Err(observed) => observed,
        };
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: format!("{what} (last observed: {last})"),
                seconds: timeout.as_secs(),
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
