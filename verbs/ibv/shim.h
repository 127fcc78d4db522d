// The C half of the ibv provider. libibverbs implements its data-path calls
// (ibv_post_send, ibv_post_recv, ibv_poll_cq, ibv_req_notify_cq) and
// ibv_query_port as static inline functions or macros, which cgo cannot
// call, and builds work requests as linked lists of structs with unions,
// which Go cannot fill without unsafe. These wrappers take flat arrays of
// plain structs instead. Go passes pointers to Go memory that holds no Go
// pointers (the ibv_sge arrays are such memory, used only during the call),
// and no function here keeps a pointer after it returns.

#ifndef TRPC_IBV_SHIM_H
#define TRPC_IBV_SHIM_H

#include <stdint.h>
#include <infiniband/verbs.h>

// TRPC_BATCH is the largest number of completions one trpc_poll_cq call
// takes, and the number of work requests trpc_post_send and trpc_post_recv
// build on the stack (longer lists are built in malloc'd memory).
enum { TRPC_BATCH = 32 };

// trpc_send is one send work request. Its scatter/gather elements are
// num_sge entries of the caller's ibv_sge array, starting at sge_off.
typedef struct {
	uint64_t wr_id;
	uint64_t remote_addr; // Write, WriteImm, Read
	uint32_t sge_off;
	uint32_t num_sge;     // 0: no scatter/gather element
	uint32_t rkey;
	uint32_t imm;         // host byte order
	uint32_t opcode;      // enum ibv_wr_opcode
	uint32_t flags;       // enum ibv_send_flags: SIGNALED, FENCE, INLINE
} trpc_send;

// trpc_recv is one receive work request, with its scatter/gather elements
// given as for trpc_send.
typedef struct {
	uint64_t wr_id;
	uint32_t sge_off;
	uint32_t num_sge;
} trpc_recv;

// trpc_wc is one completion.
typedef struct {
	uint64_t wr_id;
	uint32_t status;     // enum ibv_wc_status
	uint32_t opcode;     // enum ibv_wc_opcode; valid only on success
	uint32_t vendor_err;
	uint32_t byte_len;
	uint32_t imm;        // host byte order
	uint32_t has_imm;
	uint32_t qp_num;
	uint32_t pad_;
} trpc_wc;

// trpc_port is what the provider needs of struct ibv_port_attr.
typedef struct {
	uint32_t state;      // enum ibv_port_state
	uint32_t active_mtu; // enum ibv_mtu
	uint32_t link_layer; // IBV_LINK_LAYER_*
	uint32_t lid;
	uint32_t gid_tbl_len;
	uint32_t max_msg_sz;
} trpc_port;

// trpc_device is what the provider needs of struct ibv_device_attr(_ex).
typedef struct {
	uint64_t max_mr_size;
	uint64_t cap_flags;  // device_cap_flags_ex, or device_cap_flags
	int32_t max_qp_wr;
	int32_t max_sge;
	int32_t max_sge_rd;
	int32_t max_cqe;
	int32_t max_mw;
	int32_t max_qp_rd_atom;
	int32_t max_qp_init_rd_atom;
	int32_t phys_port_cnt;
	int32_t extended;    // 1: from ibv_query_device_ex
	int32_t pad_;
} trpc_device;

// trpc_rtr holds the attributes of the INIT to RTR transition.
typedef struct {
	uint32_t dest_qpn;
	uint32_t rq_psn;
	uint32_t path_mtu; // enum ibv_mtu
	uint32_t dlid;
	uint8_t max_dest_rd_atomic;
	uint8_t min_rnr_timer;
	uint8_t port;
	uint8_t is_global;
	uint8_t sgid_index;
	uint8_t traffic_class;
	uint8_t hop_limit;
	uint8_t pad_;
	uint8_t dgid[16];
} trpc_rtr;

// trpc_qp_caps are the capacities a created queue pair actually has.
typedef struct {
	uint32_t max_send_wr;
	uint32_t max_recv_wr;
	uint32_t max_inline_data;
	uint32_t max_send_sge;
	uint32_t max_recv_sge;
} trpc_qp_caps;

// trpc_post_send and trpc_post_recv post n requests as one chained list
// with a single ibv_post_send or ibv_post_recv. *posted is how many were
// accepted: n on success, the index of the refused request (bad_wr) on
// failure.
int trpc_post_send(struct ibv_qp *qp, const trpc_send *wrs, int n, const struct ibv_sge *sges, int *posted);
int trpc_post_recv(struct ibv_qp *qp, const trpc_recv *wrs, int n, const struct ibv_sge *sges, int *posted);
// trpc_post_bind_mw posts a signaled IBV_WR_BIND_MW that binds the type 2
// window mw to [addr, addr+length) of mr with access and the new rkey.
int trpc_post_bind_mw(struct ibv_qp *qp, uint64_t wr_id, struct ibv_mw *mw, uint32_t rkey,
	struct ibv_mr *mr, uint64_t addr, uint64_t length, int access);
// trpc_post_local_inv posts a signaled IBV_WR_LOCAL_INV of rkey.
int trpc_post_local_inv(struct ibv_qp *qp, uint64_t wr_id, uint32_t rkey);
struct ibv_mw *trpc_alloc_mw(struct ibv_pd *pd);
int trpc_dealloc_mw(struct ibv_mw *mw);
int trpc_query_device(struct ibv_context *ctx, trpc_device *out);
// trpc_probe_qp creates and destroys a throwaway RC queue pair to learn
// the capacities the device grants for sge elements and inline bytes.
int trpc_probe_qp(struct ibv_context *ctx, struct ibv_pd *pd, uint32_t sge, uint32_t max_inline, trpc_qp_caps *caps);
int trpc_poll_cq(struct ibv_cq *cq, trpc_wc *out, int n);
int trpc_req_notify_cq(struct ibv_cq *cq);
int trpc_get_cq_event(struct ibv_comp_channel *channel);
int trpc_query_port(struct ibv_context *ctx, uint8_t port, trpc_port *out);
int trpc_query_gid(struct ibv_context *ctx, uint8_t port, int index, uint8_t out[16]);
struct ibv_mr *trpc_reg_mr(struct ibv_pd *pd, uint64_t addr, uint64_t length, int access);
struct ibv_mr *trpc_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, uint64_t length, uint64_t iova, int fd, int access);
struct ibv_qp *trpc_create_qp(struct ibv_pd *pd, struct ibv_cq *send_cq, struct ibv_cq *recv_cq,
	uint32_t max_send, uint32_t max_recv, uint32_t sge, uint32_t max_inline, trpc_qp_caps *caps);
int trpc_qp_to_init(struct ibv_qp *qp, uint8_t port);
int trpc_qp_to_rtr(struct ibv_qp *qp, const trpc_rtr *a);
int trpc_qp_to_rts(struct ibv_qp *qp, uint32_t sq_psn, uint8_t timeout, uint8_t retry_cnt,
	uint8_t rnr_retry, uint8_t max_rd_atomic);
int trpc_qp_to_err(struct ibv_qp *qp);
int trpc_qp_state(struct ibv_qp *qp);

#endif
