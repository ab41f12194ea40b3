//! The peer front: `tandem.v1.Peer`, which the other routers call on this router's peer port
//! (mutual TLS, router certificates only) to learn its state ([`crate::cluster::peers`] asks
//! it) and to attach a retry to a generation running here.

use std::pin::Pin;

use futures::Stream;
use tandem_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::dispatch::GenerationService;
use crate::dispatch::log::Item;

/// Serves `tandem.v1.Peer` from the router's view in `service`.
#[derive(Clone, Debug)]
pub(crate) struct PeerService {
    pub(crate) service: GenerationService,
}

#[tonic::async_trait]
impl pb::peer_server::Peer for PeerService {
    async fn state(
        &self,
        request: Request<pb::StateRequest>,
    ) -> Result<Response<pb::StateResponse>, Status> {
        let ask = request.into_inner();
        let d = &self.service.dispatcher;
        if ask.asker == d.peers.instance {
            return Err(Status::failed_precondition("a router asked itself"));
        }
        let since = if ask.instance == d.peers.instance {
            ask.since
        } else {
            0
        };
        let changes = d.sessions.changes(since);
        let load = (d.replicas.all().iter())
            .filter(|r| r.inflight() > 0)
            .map(|r| pb::ReplicaLoad {
                addr: r.addr.clone(),
                requests: u32::try_from(r.inflight()).unwrap_or(u32::MAX),
                prompt_tokens: r.inflight_tokens(),
            })
            .collect();
        let running = (self.service.running_keys().into_iter())
            .map(|(tenant, request_id)| pb::RunningKey {
                tenant: tenant.to_string(),
                request_id,
            })
            .collect();
        Ok(Response::new(pb::StateResponse {
            instance: d.peers.instance,
            load,
            running,
            ..changes.into()
        }))
    }

    type AttachStream = Pin<Box<dyn Stream<Item = Item> + Send + 'static>>;

    async fn attach(
        &self,
        request: Request<pb::AttachRequest>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let ask = request.into_inner();
        let key = (ask.tenant.into(), ask.request_id);
        match self.service.attach_here(&key) {
            Some(frames) => Ok(Response::new(frames)),
            None => Err(Status::not_found("no such generation runs on this router")),
        }
    }
}
