//! Who may read `/metrics` (IO: TokenReview and SubjectAccessReview), as kubebuilder's
//! `filters.WithAuthenticationAndAuthorization` decides it: the bearer token must be one the API
//! server authenticates, and its user must be allowed `get` on the non-resource URL `/metrics`
//! (the chart's `gpu-operator-metrics-reader` ClusterRole grants it).
//!
//! An allowed token is remembered for [`ALLOWED_TTL`], so a scrape every 15 s reviews once
//! every few minutes instead of twice per scrape; a token whose rights are revoked is refused at
//! the latest that long afterwards. Refusals are not remembered: a fixed token works at once.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::HeaderValue;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use sha2::{Digest, Sha256};

/// How long an allowed token is served without asking the API server again.
pub const ALLOWED_TTL: Duration = Duration::from_secs(120);

/// Allowed tokens remembered at once (by digest); a few scrapers need a few.
const MAX_REMEMBERED: usize = 64;

/// The non-resource URL and verb a caller must be allowed.
pub const METRICS_PATH: &str = "/metrics";
pub const METRICS_VERB: &str = "get";

/// The answer to one request.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// No bearer token, or one the API server does not authenticate (401).
    Unauthenticated(String),
    /// Authenticated, but not allowed `get` on `/metrics` (403).
    Forbidden(String),
    /// The reviews could not be made (500).
    Failed(String),
}

pub struct Authorizer {
    /// Creates the reviews; not behind the write gate (a standby answers scrapes too).
    client: kube::Client,
    allowed: Mutex<Remembered>,
}

impl Authorizer {
    pub fn new(client: kube::Client) -> Self {
        Authorizer {
            client,
            allowed: Mutex::new(Remembered::default()),
        }
    }

    /// Whether the request carrying `authorization` may read `/metrics`.
    pub async fn check(&self, authorization: Option<&HeaderValue>) -> Verdict {
        let Some(token) = bearer_token(authorization) else {
            return Verdict::Unauthenticated(
                "send a ServiceAccount token as `Authorization: Bearer <token>`".into(),
            );
        };
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if self
            .allowed
            .lock()
            .is_ok_and(|r| r.holds(&digest, Instant::now()))
        {
            return Verdict::Allowed;
        }
        let verdict = self.review(token).await;
        if verdict == Verdict::Allowed
            && let Ok(mut remembered) = self.allowed.lock()
        {
            remembered.insert(digest, Instant::now() + ALLOWED_TTL);
        }
        verdict
    }

    async fn review(&self, token: &str) -> Verdict {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: None,
            },
            ..Default::default()
        };
        let reviewed = match Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
        {
            Ok(r) => r,
            Err(e) => return Verdict::Failed(format!("TokenReview failed: {e}")),
        };
        let status = reviewed.status.unwrap_or_default();
        let Some(user) = status.user.filter(|_| status.authenticated == Some(true)) else {
            return Verdict::Unauthenticated(format!(
                "the token was not authenticated{}",
                status.error.map(|e| format!(": {e}")).unwrap_or_default()
            ));
        };
        let username = user.username.clone().unwrap_or_default();
        let access = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(METRICS_PATH.into()),
                    verb: Some(METRICS_VERB.into()),
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        match Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &access)
            .await
        {
            Ok(r) if r.status.as_ref().is_some_and(|s| s.allowed) => Verdict::Allowed,
            Ok(_) => Verdict::Forbidden(format!(
                "{username} may not get {METRICS_PATH}: bind it to the ClusterRole that grants it (the chart's `gpu-operator-metrics-reader`)"
            )),
            Err(e) => Verdict::Failed(format!("SubjectAccessReview failed: {e}")),
        }
    }
}

/// The token of an `Authorization: Bearer <token>` header.
fn bearer_token(value: Option<&HeaderValue>) -> Option<&str> {
    let value = value?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Digests of allowed tokens and when each stops counting.
#[derive(Default)]
struct Remembered {
    until: HashMap<[u8; 32], Instant>,
}

impl Remembered {
    fn holds(&self, digest: &[u8; 32], now: Instant) -> bool {
        self.until.get(digest).is_some_and(|until| now < *until)
    }

    fn insert(&mut self, digest: [u8; 32], until: Instant) {
        let now = Instant::now();
        self.until.retain(|_, u| now < *u);
        if self.until.len() >= MAX_REMEMBERED
            && let Some(soonest) = self.until.iter().min_by_key(|(_, u)| **u).map(|(d, _)| *d)
        {
            self.until.remove(&soonest);
        }
        self.until.insert(digest, until);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_bearer_header_with_a_token_carries_one() {
        let header = |v: &str| HeaderValue::from_str(v).unwrap();
        assert_eq!(bearer_token(Some(&header("Bearer abc"))), Some("abc"));
        assert_eq!(bearer_token(Some(&header("bearer  abc "))), Some("abc"));
        assert_eq!(bearer_token(Some(&header("Basic abc"))), None);
        assert_eq!(bearer_token(Some(&header("Bearer "))), None);
        assert_eq!(bearer_token(None), None);
    }

    #[test]
    fn an_allowed_token_is_remembered_until_its_deadline_and_the_store_stays_bounded() {
        let mut r = Remembered::default();
        let now = Instant::now();
        r.insert([1; 32], now + ALLOWED_TTL);
        assert!(r.holds(&[1; 32], now));
        assert!(!r.holds(&[1; 32], now + ALLOWED_TTL));
        assert!(!r.holds(&[2; 32], now));
        for i in 0..(MAX_REMEMBERED as u16 * 2) {
            let mut d = [0; 32];
            d[..2].copy_from_slice(&i.to_be_bytes());
            d[31] = 7;
            r.insert(d, now + ALLOWED_TTL + Duration::from_millis(u64::from(i)));
        }
        assert!(r.until.len() <= MAX_REMEMBERED);
    }
}
