//! The `DevicePlugin` service: a fixed set of healthy devices, listed until the plugin
//! stops; an allocation names its devices in the container's environment.

use std::pin::Pin;

use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

use v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, Device, DevicePluginOptions,
    Empty, ListAndWatchResponse,
};

pub const API_VERSION: &str = "v1beta1";
/// The variable an allocated container finds its devices in.
pub const DEVICES_ENV: &str = "KMM_SAMPLE_DEVICES";

#[derive(Debug, Clone)]
pub struct Plugin {
    devices: Vec<Device>,
    stopped: watch::Receiver<bool>,
}

impl Plugin {
    /// `count` devices named `<resource's last segment>-<i>`.
    pub fn new(resource: &str, count: u32, stopped: watch::Receiver<bool>) -> Self {
        let stem = resource.rsplit('/').next().unwrap_or(resource);
        let devices = (0..count)
            .map(|i| Device {
                id: format!("{stem}-{i}"),
                health: "Healthy".to_owned(),
            })
            .collect();
        Self { devices, stopped }
    }

    pub fn service(self) -> DevicePluginServer<Self> {
        DevicePluginServer::new(self)
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions::default()))
    }

    type ListAndWatchStream = DeviceStream;

    /// The devices once, then nothing until the plugin stops, which ends the stream: the
    /// kubelet then counts the devices as gone.
    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let first = ListAndWatchResponse {
            devices: self.devices.clone(),
        };
        let mut stopped = self.stopped.clone();
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            if tx.send(Ok(first)).await.is_ok() {
                tokio::select! {
                    _ = stopped.wait_for(|stop| *stop) => {}
                    () = tx.closed() => {}
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| ContainerAllocateResponse {
                envs: [(DEVICES_ENV.to_owned(), c.devices_ids.join(","))].into(),
            })
            .collect();
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    use super::*;

    #[tokio::test]
    async fn devices_are_listed_until_the_plugin_stops() {
        let (stop, stopped) = watch::channel(false);
        let plugin = Plugin::new("example.com/widget", 2, stopped);
        let mut stream = plugin
            .list_and_watch(Request::new(Empty {}))
            .await
            .unwrap()
            .into_inner();
        let first = stream.next().await.unwrap().unwrap();
        let ids: Vec<&str> = first.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["widget-0", "widget-1"]);
        assert!(first.devices.iter().all(|d| d.health == "Healthy"));
        stop.send(true).unwrap();
        assert!(
            stream.next().await.is_none(),
            "the stream ends with the plugin"
        );
    }

    #[tokio::test]
    async fn an_allocation_names_its_devices_to_the_container() {
        let (_stop, stopped) = watch::channel(false);
        let plugin = Plugin::new("example.com/widget", 2, stopped);
        let response = plugin
            .allocate(Request::new(AllocateRequest {
                container_requests: vec![v1beta1::ContainerAllocateRequest {
                    devices_ids: vec!["widget-1".into()],
                }],
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            response.container_responses[0].envs[DEVICES_ENV],
            "widget-1"
        );
    }
}
