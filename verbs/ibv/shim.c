//go:build linux && cgo && rdma

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include "shim.h"

int trpc_post_send(struct ibv_qp *qp, const trpc_send *wrs, int n, const struct ibv_sge *sges, int *posted) {
	struct ibv_send_wr stack[TRPC_BATCH];
	struct ibv_send_wr *wr = stack;
	struct ibv_send_wr *bad = NULL;
	int i, rc;

	*posted = 0;
	if (n <= 0)
		return EINVAL;
	if (n > TRPC_BATCH) {
		wr = calloc((size_t)n, sizeof wr[0]);
		if (wr == NULL)
			return ENOMEM;
	} else {
		memset(wr, 0, sizeof(wr[0]) * n);
	}
	for (i = 0; i < n; i++) {
		const trpc_send *w = &wrs[i];
		wr[i].wr_id = w->wr_id;
		wr[i].next = i + 1 < n ? &wr[i + 1] : NULL;
		// ibv_post_send only reads the list: the cast drops const.
		wr[i].sg_list = w->num_sge > 0 ? (struct ibv_sge *)&sges[w->sge_off] : NULL;
		wr[i].num_sge = (int)w->num_sge;
		wr[i].opcode = (enum ibv_wr_opcode)w->opcode;
		wr[i].send_flags = w->flags;
		if (w->opcode == IBV_WR_SEND_WITH_IMM || w->opcode == IBV_WR_RDMA_WRITE_WITH_IMM)
			wr[i].imm_data = htonl(w->imm);
		wr[i].wr.rdma.remote_addr = w->remote_addr;
		wr[i].wr.rdma.rkey = w->rkey;
	}
	rc = ibv_post_send(qp, wr, &bad);
	if (rc == 0)
		*posted = n;
	else if (bad != NULL && bad >= wr && bad < wr + n)
		*posted = (int)(bad - wr);
	if (wr != stack)
		free(wr);
	return rc;
}

int trpc_post_recv(struct ibv_qp *qp, const trpc_recv *wrs, int n, const struct ibv_sge *sges, int *posted) {
	struct ibv_recv_wr stack[TRPC_BATCH];
	struct ibv_recv_wr *wr = stack;
	struct ibv_recv_wr *bad = NULL;
	int i, rc;

	*posted = 0;
	if (n <= 0)
		return EINVAL;
	if (n > TRPC_BATCH) {
		wr = calloc((size_t)n, sizeof wr[0]);
		if (wr == NULL)
			return ENOMEM;
	}
	for (i = 0; i < n; i++) {
		wr[i].wr_id = wrs[i].wr_id;
		wr[i].next = i + 1 < n ? &wr[i + 1] : NULL;
		wr[i].sg_list = wrs[i].num_sge > 0 ? (struct ibv_sge *)&sges[wrs[i].sge_off] : NULL;
		wr[i].num_sge = (int)wrs[i].num_sge;
	}
	rc = ibv_post_recv(qp, wr, &bad);
	if (rc == 0)
		*posted = n;
	else if (bad != NULL && bad >= wr && bad < wr + n)
		*posted = (int)(bad - wr);
	if (wr != stack)
		free(wr);
	return rc;
}

int trpc_post_bind_mw(struct ibv_qp *qp, uint64_t wr_id, struct ibv_mw *mw, uint32_t rkey,
	struct ibv_mr *mr, uint64_t addr, uint64_t length, int access) {
	struct ibv_send_wr wr, *bad = NULL;

	memset(&wr, 0, sizeof wr);
	wr.wr_id = wr_id;
	wr.opcode = IBV_WR_BIND_MW;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.bind_mw.mw = mw;
	wr.bind_mw.rkey = rkey;
	wr.bind_mw.bind_info.mr = mr;
	wr.bind_mw.bind_info.addr = addr;
	wr.bind_mw.bind_info.length = length;
	wr.bind_mw.bind_info.mw_access_flags = (unsigned int)access;
	return ibv_post_send(qp, &wr, &bad);
}

int trpc_post_local_inv(struct ibv_qp *qp, uint64_t wr_id, uint32_t rkey) {
	struct ibv_send_wr wr, *bad = NULL;

	memset(&wr, 0, sizeof wr);
	wr.wr_id = wr_id;
	wr.opcode = IBV_WR_LOCAL_INV;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.invalidate_rkey = rkey;
	return ibv_post_send(qp, &wr, &bad);
}

struct ibv_mw *trpc_alloc_mw(struct ibv_pd *pd) {
	return ibv_alloc_mw(pd, IBV_MW_TYPE_2);
}

int trpc_dealloc_mw(struct ibv_mw *mw) {
	return ibv_dealloc_mw(mw);
}

int trpc_query_device(struct ibv_context *ctx, trpc_device *out) {
	struct ibv_device_attr_ex ex;
	struct ibv_device_attr *a = &ex.orig_attr;
	int rc;

	memset(&ex, 0, sizeof ex);
	memset(out, 0, sizeof *out);
	rc = ibv_query_device_ex(ctx, NULL, &ex);
	if (rc == 0) {
		out->extended = 1;
		out->cap_flags = ex.device_cap_flags_ex | a->device_cap_flags;
	} else {
		memset(&ex, 0, sizeof ex);
		rc = ibv_query_device(ctx, a);
		if (rc != 0)
			return rc;
		out->cap_flags = a->device_cap_flags;
	}
	out->max_mr_size = a->max_mr_size;
	out->max_qp_wr = a->max_qp_wr;
	out->max_sge = a->max_sge;
	out->max_sge_rd = a->max_sge_rd;
	out->max_cqe = a->max_cqe;
	out->max_mw = a->max_mw;
	out->max_qp_rd_atom = a->max_qp_rd_atom;
	out->max_qp_init_rd_atom = a->max_qp_init_rd_atom;
	out->phys_port_cnt = a->phys_port_cnt;
	return 0;
}

int trpc_probe_qp(struct ibv_context *ctx, struct ibv_pd *pd, uint32_t sge, uint32_t max_inline, trpc_qp_caps *caps) {
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	int rc = 0;

	cq = ibv_create_cq(ctx, 2, NULL, NULL, 0);
	if (cq == NULL)
		return errno ? errno : ENOMEM;
	qp = trpc_create_qp(pd, cq, cq, 1, 1, sge, max_inline, caps);
	if (qp == NULL)
		rc = errno ? errno : EINVAL;
	else
		ibv_destroy_qp(qp);
	ibv_destroy_cq(cq);
	return rc;
}

int trpc_poll_cq(struct ibv_cq *cq, trpc_wc *out, int n) {
	struct ibv_wc wc[TRPC_BATCH];
	int i, got;

	if (n > TRPC_BATCH)
		n = TRPC_BATCH;
	got = ibv_poll_cq(cq, n, wc);
	for (i = 0; i < got; i++) {
		out[i].wr_id = wc[i].wr_id;
		out[i].status = wc[i].status;
		out[i].opcode = wc[i].opcode;
		out[i].vendor_err = wc[i].vendor_err;
		out[i].byte_len = wc[i].byte_len;
		out[i].has_imm = wc[i].status == IBV_WC_SUCCESS && (wc[i].wc_flags & IBV_WC_WITH_IMM) != 0;
		out[i].imm = out[i].has_imm ? ntohl(wc[i].imm_data) : 0;
		out[i].qp_num = wc[i].qp_num;
		out[i].pad_ = 0;
	}
	return got;
}

int trpc_req_notify_cq(struct ibv_cq *cq) {
	return ibv_req_notify_cq(cq, 0);
}

// trpc_get_cq_event takes one event from a channel whose fd is non-blocking
// and acknowledges it at once. It returns 1 when it took an event, 0 when
// there was none, and -errno on failure.
int trpc_get_cq_event(struct ibv_comp_channel *channel) {
	struct ibv_cq *cq;
	void *ctx;

	if (ibv_get_cq_event(channel, &cq, &ctx) != 0)
		return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
	ibv_ack_cq_events(cq, 1);
	return 1;
}

int trpc_query_port(struct ibv_context *ctx, uint8_t port, trpc_port *out) {
	struct ibv_port_attr attr;
	int rc;

	memset(&attr, 0, sizeof attr);
	rc = ibv_query_port(ctx, port, &attr);
	if (rc != 0)
		return rc;
	out->max_msg_sz = attr.max_msg_sz;
	out->state = attr.state;
	out->active_mtu = attr.active_mtu;
	out->link_layer = attr.link_layer;
	out->lid = attr.lid;
	out->gid_tbl_len = attr.gid_tbl_len;
	return 0;
}

int trpc_query_gid(struct ibv_context *ctx, uint8_t port, int index, uint8_t out[16]) {
	union ibv_gid gid;

	if (ibv_query_gid(ctx, port, index, &gid) != 0)
		return errno ? errno : EINVAL;
	memcpy(out, gid.raw, 16);
	return 0;
}

struct ibv_mr *trpc_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, uint64_t length, uint64_t iova, int fd, int access) {
	return ibv_reg_dmabuf_mr(pd, offset, (size_t)length, iova, fd, access);
}

struct ibv_mr *trpc_reg_mr(struct ibv_pd *pd, uint64_t addr, uint64_t length, int access) {
	return ibv_reg_mr(pd, (void *)(uintptr_t)addr, (size_t)length, access);
}

struct ibv_qp *trpc_create_qp(struct ibv_pd *pd, struct ibv_cq *send_cq, struct ibv_cq *recv_cq,
	uint32_t max_send, uint32_t max_recv, uint32_t sge, uint32_t max_inline, trpc_qp_caps *caps) {
	struct ibv_qp_init_attr attr;
	struct ibv_qp *qp;

	memset(&attr, 0, sizeof attr);
	attr.send_cq = send_cq;
	attr.recv_cq = recv_cq;
	attr.qp_type = IBV_QPT_RC;
	// Each send request says whether it is signaled (SendRequest.Unsignaled).
	attr.sq_sig_all = 0;
	attr.cap.max_send_wr = max_send;
	attr.cap.max_recv_wr = max_recv;
	attr.cap.max_send_sge = sge;
	attr.cap.max_recv_sge = sge;
	attr.cap.max_inline_data = max_inline;
	qp = ibv_create_qp(pd, &attr);
	if (qp == NULL)
		return NULL;
	caps->max_send_wr = attr.cap.max_send_wr;
	caps->max_recv_wr = attr.cap.max_recv_wr;
	caps->max_inline_data = attr.cap.max_inline_data;
	caps->max_send_sge = attr.cap.max_send_sge;
	caps->max_recv_sge = attr.cap.max_recv_sge;
	return qp;
}

int trpc_qp_to_init(struct ibv_qp *qp, uint8_t port) {
	struct ibv_qp_attr attr;

	memset(&attr, 0, sizeof attr);
	attr.qp_state = IBV_QPS_INIT;
	attr.pkey_index = 0;
	attr.port_num = port;
	// The memory regions decide what a peer may do; the queue pair allows
	// every kind of access a region can grant.
	attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	return ibv_modify_qp(qp, &attr,
		IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

int trpc_qp_to_rtr(struct ibv_qp *qp, const trpc_rtr *a) {
	struct ibv_qp_attr attr;

	memset(&attr, 0, sizeof attr);
	attr.qp_state = IBV_QPS_RTR;
	attr.path_mtu = (enum ibv_mtu)a->path_mtu;
	attr.dest_qp_num = a->dest_qpn;
	attr.rq_psn = a->rq_psn;
	attr.max_dest_rd_atomic = a->max_dest_rd_atomic;
	attr.min_rnr_timer = a->min_rnr_timer;
	attr.ah_attr.port_num = a->port;
	attr.ah_attr.sl = 0;
	attr.ah_attr.src_path_bits = 0;
	attr.ah_attr.dlid = (uint16_t)a->dlid;
	if (a->is_global) {
		attr.ah_attr.is_global = 1;
		memcpy(attr.ah_attr.grh.dgid.raw, a->dgid, 16);
		attr.ah_attr.grh.sgid_index = a->sgid_index;
		attr.ah_attr.grh.hop_limit = a->hop_limit;
		attr.ah_attr.grh.traffic_class = a->traffic_class;
		attr.ah_attr.grh.flow_label = 0;
	}
	return ibv_modify_qp(qp, &attr,
		IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
		IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

int trpc_qp_to_rts(struct ibv_qp *qp, uint32_t sq_psn, uint8_t timeout, uint8_t retry_cnt,
	uint8_t rnr_retry, uint8_t max_rd_atomic) {
	struct ibv_qp_attr attr;

	memset(&attr, 0, sizeof attr);
	attr.qp_state = IBV_QPS_RTS;
	attr.sq_psn = sq_psn;
	attr.timeout = timeout;
	attr.retry_cnt = retry_cnt;
	attr.rnr_retry = rnr_retry;
	attr.max_rd_atomic = max_rd_atomic;
	return ibv_modify_qp(qp, &attr,
		IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
		IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
}

int trpc_qp_to_err(struct ibv_qp *qp) {
	struct ibv_qp_attr attr;

	memset(&attr, 0, sizeof attr);
	attr.qp_state = IBV_QPS_ERR;
	return ibv_modify_qp(qp, &attr, IBV_QP_STATE);
}

// trpc_qp_state returns the queue pair's enum ibv_qp_state, or -errno.
int trpc_qp_state(struct ibv_qp *qp) {
	struct ibv_qp_attr attr;
	struct ibv_qp_init_attr init;
	int rc;

	rc = ibv_query_qp(qp, &attr, IBV_QP_STATE, &init);
	if (rc != 0)
		return -rc;
	return attr.qp_state;
}
