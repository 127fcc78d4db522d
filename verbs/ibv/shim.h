// The C half of the ibv provider. libibverbs implements its data-path calls
// (ibv_post_send, ibv_post_recv, ibv_poll_cq, ibv_req_notify_cq) and
// ibv_query_port as static inline functions or macros, which cgo cannot
// call, and builds work requests as linked lists of structs with unions,
// which Go cannot fill without unsafe. These wrappers take flat arrays of
// plain structs instead. Go passes pointers to Go memory that holds no Go
// pointers, and no function here keeps a pointer after it returns.

#ifndef TRPC_IBV_SHIM_H
#define TRPC_IBV_SHIM_H

#include <stdint.h>
#include <infiniband/verbs.h>

// TRPC_BATCH is the largest number of work requests or completions one call
// handles; Go splits longer lists.
enum { TRPC_BATCH = 32 };

// trpc_send is one send work request with one scatter/gather element.
typedef struct {
	uint64_t wr_id;
	uint64_t addr;        // local virtual address
	uint64_t remote_addr; // Write, WriteImm, Read
	uint32_t length;      // 0: no scatter/gather element
	uint32_t lkey;
	uint32_t rkey;
	uint32_t imm;         // host byte order
	uint32_t opcode;      // enum ibv_wr_opcode
	uint32_t flags;       // extra enum ibv_send_flags (IBV_SEND_INLINE)
} trpc_send;

// trpc_recv is one receive work request with one scatter/gather element.
typedef struct {
	uint64_t wr_id;
	uint64_t addr;
	uint32_t length; // 0: no scatter/gather element
	uint32_t lkey;
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
} trpc_port;

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
} trpc_qp_caps;

int trpc_post_send(struct ibv_qp *qp, const trpc_send *wrs, int n, int *failed);
int trpc_post_recv(struct ibv_qp *qp, const trpc_recv *wrs, int n, int *failed);
int trpc_poll_cq(struct ibv_cq *cq, trpc_wc *out, int n);
int trpc_req_notify_cq(struct ibv_cq *cq);
int trpc_get_cq_event(struct ibv_comp_channel *channel);
int trpc_query_port(struct ibv_context *ctx, uint8_t port, trpc_port *out);
int trpc_query_gid(struct ibv_context *ctx, uint8_t port, int index, uint8_t out[16]);
struct ibv_mr *trpc_reg_mr(struct ibv_pd *pd, uint64_t addr, uint64_t length, int access);
struct ibv_mr *trpc_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, uint64_t length, uint64_t iova, int fd, int access);
struct ibv_qp *trpc_create_qp(struct ibv_pd *pd, struct ibv_cq *send_cq, struct ibv_cq *recv_cq,
	uint32_t max_send, uint32_t max_recv, uint32_t max_inline, trpc_qp_caps *caps);
int trpc_qp_to_init(struct ibv_qp *qp, uint8_t port);
int trpc_qp_to_rtr(struct ibv_qp *qp, const trpc_rtr *a);
int trpc_qp_to_rts(struct ibv_qp *qp, uint32_t sq_psn, uint8_t timeout, uint8_t retry_cnt,
	uint8_t rnr_retry, uint8_t max_rd_atomic);
int trpc_qp_to_err(struct ibv_qp *qp);
int trpc_qp_state(struct ibv_qp *qp);

#endif
